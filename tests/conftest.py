import pytest
import torch

from nanocolossal.context import gpc


@pytest.fixture(autouse=True)
def _single_thread_and_clean_context():
    """Tests that launch in-process must leave no process group behind for the next one."""
    torch.set_num_threads(1)
    yield
    gpc.destroy()
