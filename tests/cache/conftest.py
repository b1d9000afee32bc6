"""Cache tests run tiny torch ops: one intra-op thread avoids OpenMP spin contention on a loaded 2-core
machine (it made these tests ~8x slower there). Scoped to this directory and restored after each test."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
