"""TRT-LLM bridge tests: those that force the KVX kernels on CPU tensors run them under the interpreter."""
import pytest
import torch

from kvx_core.ops import dispatch

from .. import interpret  # noqa: F401  (TRITON_INTERPRET=1 off CUDA)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The KVX kernels forced on these tests' CPU pools, under Triton's interpreter, which serves CPU tensors only
    where no CUDA GPU is (the interpreter is off there). On the GPU machine the same KV_OFFSETS paths run on CUDA
    pools in tests/kernels/test_kv_offsets_kernels.py and test_bound_layer.py."""
    if torch.cuda.is_available():
        pytest.skip("forces the kernels on CPU pools, which only Triton's interpreter (off CUDA) runs")
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
