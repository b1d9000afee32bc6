"""Kernel tests run on CUDA when present, else on CPU under TRITON_INTERPRET=1 (set before triton loads)."""
import pytest
import torch

from .. import interpret  # noqa: F401  (TRITON_INTERPRET=1 off CUDA)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def kernels_here(monkeypatch):
    """Pools on this device bind for and run the kernels (on the CPU: Triton's interpreter)."""
    from kvx_core.ops import dispatch

    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: needs a CUDA GPU (run `pytest -m gpu tests/kernels` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
