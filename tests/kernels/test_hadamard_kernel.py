"""The fused Hadamard rotation kernel (`ops.triton.hadamard`) against the torch butterfly it replaces on CUDA.

Oracles: `formats.rotation.rotate` on CPU (the stage-by-stage torch butterfly) for bit equality, and the
orthonormal Sylvester matrix in FP64 for accuracy. Adversarial rows: NaN, +-inf, each dtype's extremes,
rows beyond FP32_MAX/D (saturation), non-contiguous views, empty and odd row counts.
"""
import pytest
import torch

from kvx_core.formats import get_format, hadamard
from kvx_core.formats.rotation import rotate
from kvx_core.ops.triton.hadamard import hadamard_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(d: int, dtype: torch.dtype, n: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x = x.to(dtype)
    big = torch.finfo(dtype).max
    x[3, 0], x[5, -1], x[6, 0] = float("nan"), float("inf"), -float("inf")
    x[7], x[8] = big, -big
    x[9, ::2] = big
    x[10] = 0.0
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_torch_butterfly_bit_for_bit(device, d, dtype):
    x = _rows(d, dtype)
    for out_dtype in (dtype, torch.float32, torch.bfloat16, torch.float16):
        want = rotate(x, out_dtype)  # CPU: the torch butterfly
        got = hadamard_rows(x.to(device), out_dtype).cpu()
        assert got.dtype == out_dtype and _same(got, want), (d, dtype, out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_rows_stay_finite_and_non_finite_rows_stay_poisoned(device, dtype):
    x = _rows(128, dtype).to(device)
    y = hadamard_rows(x, dtype)
    finite = x.isfinite().all(-1)
    assert y[finite].isfinite().all()
    assert (~y[~finite].isfinite()).any(-1).all()


def test_accuracy_against_the_orthonormal_matrix(device):
    x = torch.randn(64, 128, dtype=torch.float32)
    want = x.double() @ hadamard(128, torch.float64)
    got = hadamard_rows(x.to(device), torch.float32).cpu().double()
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_rows_are_batch_invariant_and_strides_honoured(device):
    x = torch.randn(3, 64, 2, 128, device=device)[:, :, 1]  # non-contiguous rows
    whole = hadamard_rows(x, torch.float32)
    for n in (1, 5, 17, 64):
        assert torch.equal(hadamard_rows(x[:, :n], torch.float32), whole[:, :n])
    assert hadamard_rows(x[:, :0], torch.bfloat16).shape == (3, 0, 128)


@pytest.mark.parametrize("name", ["nvfp4_rot", "int4_rot", "mxfp4_rot", "k8v4_rot"])
@pytest.mark.parametrize("dtype,big", [(torch.float16, 60000.0), (torch.bfloat16, 3e38), (torch.float32, 3e38),
                                       (torch.float64, 1.7e308)])
def test_rotated_formats_keep_huge_finite_rows_finite(name, dtype, big):
    """Finite inputs saturate (docs/formats.md §16.7): a row of huge values decodes finite, no NaN group."""
    fmt = get_format(name)
    x = torch.full((4, 64), big, dtype=dtype)
    x[1] = -big
    for enc, dec in ((fmt.encode_k, fmt.decode_k), (fmt.encode_v, fmt.decode_v)):
        assert dec(*enc(x)).isfinite().all(), (name, dtype)


@pytest.mark.gpu
def test_rotate_on_cuda_runs_the_kernel_and_matches_cpu():
    x = _rows(128, torch.bfloat16)
    assert _same(rotate(x.cuda()).cpu(), rotate(x))


def test_strided_head_rows_are_read_in_place_and_match_the_butterfly(device):
    """vLLM's K/V: `[T, H, D]` views of a QKV projection row (token stride > H * D): the kernel reads the rows by
    their (token, head) strides, no copy, same bits as the contiguous rows."""
    qkv = _rows(64, torch.bfloat16, n=5 * 12).view(5, 12, 64).to(device)  # [T, Hq + 2 Hkv, D]
    k = qkv[:, 8:10]
    assert not k.is_contiguous()
    assert _same(hadamard_rows(k, torch.bfloat16).cpu(), rotate(k.cpu().contiguous()))


@pytest.mark.gpu
def test_rotate_kv_is_one_launch_over_adjacent_k_v_and_bit_identical():
    from kvx_core.ops.rotation import _v_follows_k, rotate_kv
    qkv = _rows(128, torch.bfloat16, n=7 * 12).view(7, 12, 128).cuda()
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    assert _v_follows_k(k, v) and not _v_follows_k(k, v.clone()) and not _v_follows_k(v, k)
    for kk, vv in ((k, v), (k, v.clone())):
        rk, rv = rotate_kv(kk, vv)
        assert _same(rk.cpu(), rotate(kk.cpu().contiguous())) and _same(rv.cpu(), rotate(vv.cpu().contiguous()))
