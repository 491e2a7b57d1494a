import gc
import os
import sys

# torch's store client looks up the name of the store it meets (a reverse DNS query for
# 127.0.0.1 as an IPv6-mapped address, which /etc/hosts does not answer). Where the DNS server
# drops such a query, glibc waits its default 5 s before asking again, and the whole job waits
# with it: on the CI machines a few launches in a hundred. Here a dropped query fails after 1 s,
# and torch then stops looking names up in that process (it logs one warning), so each pooled
# rank waits once at most.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
# The suite starts hundreds of Python processes (torchrun's ranks, launchers, scripts); where the
# environment says PYTHONDONTWRITEBYTECODE, each would compile nanocolossal afresh (~0.3 s).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import dist_helpers  # noqa: E402
import pytest  # noqa: E402

dist_helpers.start_server()  # before `import torch` here, so the two imports run side by side
import torch  # noqa: E402

from nanocolossal.context import gpc  # noqa: E402


@pytest.fixture(autouse=True)
def _single_thread_and_clean_context():
    """Tests that launch in-process must leave no process group behind for the next one."""
    torch.set_num_threads(1)
    yield
    gpc.destroy()


def pytest_collection_modifyitems(items):
    """The tutorials' ResNets (marked slow) first: under `-n 2` they then run beside the short
    tests instead of side by side at the end, where each waited on the other's cores."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort


def pytest_sessionfinish():
    gc.freeze()  # the interpreter's exit then skips a sweep over torch's objects (about 0.4 s)
