"""The same references on a CUDA device give bit-identical bytes and values (formats are device-agnostic)."""
import numpy as np
import pytest
import torch

from kvx_core.formats import FP8Format, IdentityFormat, IntFormat, MXFP4Format, NVFP4Format

from . import oracles as O

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

FORMATS = [IdentityFormat("bf16"), IdentityFormat("fp16"), FP8Format("fp8_e4m3"), FP8Format("fp8_e5m2"),
           IntFormat(8), IntFormat(4), MXFP4Format(16), MXFP4Format(32), MXFP4Format(16, "floor"),
           MXFP4Format(32, "floor"), NVFP4Format()]


def _data() -> np.ndarray:
    rng = np.random.default_rng(50)
    x = O.random_kv(rng, (256, 4, 128), log10_range=(-30, 30))
    x[0, 0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.0, 0, 1e-45, -1e-40,
                    448 * 6, 464 * 6, 2.0 ** -10 * 6, 3e38]
    x[1, 0, 3] = np.nan
    x[1, 1, 70] = np.inf
    x[2, 2, :] = 0.0
    return x.astype(np.float32)


CASES = [(f, False) for f in FORMATS] + [(f, True) for f in FORMATS if f.uses_global_scale]


@pytest.mark.parametrize("fmt,per_head", CASES, ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_cuda_matches_cpu_bit_exact(fmt, per_head):
    x = torch.from_numpy(_data())
    g = None
    if fmt.uses_global_scale:
        g = torch.tensor([0.5, 1.0, 2.0 ** -7, 3.3]) if per_head else torch.tensor(0.0123)
    p_cpu, s_cpu = fmt.encode(x, g)
    p_gpu, s_gpu = fmt.encode(x.cuda(), None if g is None else g.cuda())
    if isinstance(fmt, IdentityFormat):  # a plain cast: NaN bit patterns are the device's own
        O.assert_same_float(p_gpu.cpu().float().numpy(), p_cpu.float().numpy())
    else:
        assert torch.equal(p_gpu.cpu().view(torch.uint8), p_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    d_cpu = fmt.decode(p_cpu, s_cpu, g)
    d_gpu = fmt.decode(p_gpu, s_gpu, None if g is None else g.cuda()).cpu()
    O.assert_same_float(d_gpu.numpy(), d_cpu.numpy())
    if isinstance(fmt, NVFP4Format):
        op, os_ = O.nvfp4_encode(x.numpy(), None if g is None else g.numpy())
        assert np.array_equal(p_gpu.cpu().numpy(), op) and np.array_equal(s_gpu.cpu().numpy(), os_)
