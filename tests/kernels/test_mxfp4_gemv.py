"""The MXFP4 linear kernel (`ops.triton.mxfp4_gemv`) against an fp64 oracle of the decoded weight: exact where every
sum is exact in fp16, within the output's rounding (plus FP32 summation) elsewhere; ragged shapes (M across the row
tile, N not a multiple of the feature tile, K chunks of 32 .. 256), strided and 3-D inputs, zero groups and scales
far from 1. Runs on CUDA, else in Triton's CPU interpreter (small shapes)."""
from __future__ import annotations

import pytest
import torch

from kvx_core.errors import KvxError
from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4
from kvx_core.ops.triton.mxfp4_gemv import mxfp4_linear_triton


def _weight(n: int, k: int, seed: int, big: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero group
    w[1 % n] *= 2.0 ** big  # scales far from 1, both ways (exact in bf16)
    w[2 % n] *= 2.0 ** -30
    return w


def _oracle(x: torch.Tensor, wq) -> torch.Tensor:
    return x.double() @ wq.dequantize(dtype=torch.float64).T


def test_sums_exact_in_fp16_come_out_exact(device):
    g = torch.Generator().manual_seed(1)
    k = 96
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = grid[torch.randint(0, 8, (40, k), generator=g)] * torch.where(torch.rand(40, k, generator=g) < 0.5, -1, 1)
    w[:, 0] = 6.0  # every group's scale is 1: the weight is its own MXFP4 grid
    w[:, 32] = 6.0
    w[:, 64] = 6.0
    wq = quantize_mxfp4(w)
    assert torch.equal(wq.dequantize(), w)
    x = torch.randint(-1, 2, (5, k), generator=g).half()
    got = mxfp4_linear_triton(x.to(device), wq.payload.to(device), wq.scales.to(device))
    assert torch.equal(got.cpu().double(), _oracle(x, wq))


def test_bf16_fast_path_is_exact_where_the_sums_are(device):
    """bf16 x with scale bytes <= 128 takes the decode without FP32 (`max_scale` known): sums of two grid values times
    scales from 2**-40 to 2 are exact in bf16, so the output equals the fp64 oracle on both paths."""
    g = torch.Generator().manual_seed(4)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = grid[torch.randint(0, 8, (48, 96), generator=g)] * torch.where(torch.rand(48, 96, generator=g) < 0.5, -1, 1)
    w[:, ::32] = 6.0
    w *= (2.0 ** torch.randint(-40, 2, (48, 1), generator=g)).float()
    wq = quantize_mxfp4(w)
    assert wq.max_scale <= 128 and torch.equal(wq.dequantize(), w)
    x = torch.zeros(3, 96)
    x[0, 5], x[0, 70] = 1.0, -1.0
    x[1, 31], x[1, 32] = -1.0, 1.0
    x[2, 0], x[2, 95] = 1.0, 1.0
    x = x.bfloat16()
    ref = _oracle(x, wq)
    for max_scale in (wq.max_scale, None):
        got = mxfp4_linear_triton(x.to(device), wq.payload.to(device), wq.scales.to(device), max_scale=max_scale)
        assert torch.equal(got.cpu().double(), ref), max_scale


@pytest.mark.parametrize("m,n,k", [(1, 70, 96), (17, 33, 64), (3, 129, 576), (2, 40, 352)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_the_fp64_oracle_within_rounding(device, m, n, k, dtype):
    big = 20 if dtype == torch.bfloat16 else 8  # fp16 tops at 65504
    wq = quantize_mxfp4(_weight(n, k, m + n, big=big if m != 3 else -2))  # m == 3: scales <= 128, the bf16 fast path
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(m, k + 8, generator=g).to(dtype)
    x = wide[:, 4:4 + k]  # row stride k + 8: not contiguous
    x[0, :16] = 0.0
    w_dev = wq.to(device)
    got = mxfp4_linear(x.to(device), w_dev, backend="triton").cpu().double()
    ref = _oracle(x, wq)
    if dtype == torch.float16:  # the reference's fp16 weight loses what fp16 cannot hold; compare like with like
        ref = x.double() @ wq.dequantize(dtype=torch.float16).double().T
    mag = x.double().abs() @ wq.dequantize(dtype=torch.float64).abs().T
    # bf16 output rounding (the CPU interpreter truncates fp32 -> bf16: one more bit), fp16 rounding
    eps = (2.0 ** -8 if device == "cuda" else 2.0 ** -7) if dtype == torch.bfloat16 else 2.0 ** -11
    bound = eps * ref.abs() + 2.0 ** -20 * mag + 1e-30
    assert bool(((got - ref).abs() <= bound).all())
    torch_ref = mxfp4_linear(x.to(device), w_dev, backend="torch").cpu().double()
    assert bool(((got - torch_ref).abs() <= 2 * bound).all())


def test_three_d_input_and_refusals(device):
    wq = quantize_mxfp4(_weight(20, 64, 3))
    w_dev = wq.to(device)
    x = torch.randn(2, 3, 64).bfloat16().to(device)
    got = mxfp4_linear(x, w_dev, backend="triton")
    assert got.shape == (2, 3, 20)
    assert torch.equal(got[1, 2], mxfp4_linear(x[1, 2:3], w_dev, backend="triton")[0])
    with pytest.raises(KvxError):
        mxfp4_linear_triton(x[0].float(), w_dev.payload, w_dev.scales)  # fp32 activations: the reference's job
    with pytest.raises(KvxError):
        mxfp4_linear(x, w_dev, backend="cuda")


@pytest.mark.gpu
def test_gpt_oss_head_shape_on_the_gpu():
    """A 201088 x 2880 head (gpt-oss) slice of 8192 rows at M = 1 and 64: within the bf16 bound of the oracle."""
    wq = quantize_mxfp4(_weight(8192, 2880, 7))
    w_dev = wq.to("cuda")
    for m in (1, 64):
        x = torch.randn(m, 2880).bfloat16()
        got = mxfp4_linear(x.cuda(), w_dev).cpu().double()
        ref = _oracle(x, wq)
        mag = x.double().abs() @ wq.dequantize(dtype=torch.float64).abs().T
        assert bool(((got - ref).abs() <= 2.0 ** -8 * ref.abs() + 2.0 ** -20 * mag).all())
