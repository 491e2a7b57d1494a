import gc

import dist_helpers
import pytest

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
