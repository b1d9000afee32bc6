"""MXFP4 lm_head weights (kvx_core/mxfp4_linear.py): the codec is the formats' MXFP4 (group 32), exact on
representable weights, checked against ml_dtypes' float4_e2m1fn decoding; the chunked product equals the dense one."""
import ml_dtypes
import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats.mxfp4 import MXFP4Format
from kvx_core.mxfp4_linear import GROUP, Mxfp4Weight, mxfp4_linear, quantize_mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _representable(rows, cols, seed=0):
    """Weights on the MXFP4 grid: each group of 32 holds +-6 * 2^e (so its scale is 2^e) and E2M1 multiples."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor(E2M1)[torch.randint(0, 8, (rows, cols), generator=g)]
    codes *= torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    codes[:, ::GROUP] = 6.0
    exps = torch.randint(-20, 20, (rows, cols // GROUP), generator=g).float()
    return codes * torch.exp2(exps).repeat_interleave(GROUP, dim=1)


def test_quantize_is_the_formats_mxfp4_32():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)) * 3
    q = quantize_mxfp4(w)
    payload, scales = MXFP4Format(group_size=32).encode(w)
    assert torch.equal(q.payload, payload) and torch.equal(q.scales, scales)
    assert (q.out_features, q.in_features, q.nbytes) == (40, 96, 40 * 48 + 40 * 3)


def test_quantize_in_row_chunks_equals_one_encode():
    """Past DEFAULT_CHUNK_ROWS rows the encode runs a chunk at a time (bounded memory for a 201088-row head): the
    same bytes as one encode, including the rows across the chunk boundary and the max scale."""
    from kvx_core.mxfp4_linear import DEFAULT_CHUNK_ROWS
    w = torch.randn(DEFAULT_CHUNK_ROWS + 5, 32, generator=torch.Generator().manual_seed(4))
    w[-1] *= 2.0 ** 30  # the largest scale sits in the last chunk
    q = quantize_mxfp4(w)
    payload, scales = MXFP4Format(group_size=32).encode(w)
    assert torch.equal(q.payload, payload) and torch.equal(q.scales, scales)
    assert q.max_scale == int(scales.max())


def test_representable_weights_round_trip_exactly_and_match_ml_dtypes():
    w = _representable(17, 128)
    q = quantize_mxfp4(w)
    assert torch.equal(q.dequantize(), w)
    # independent decode: nibbles through ml_dtypes' float4_e2m1fn, scales as 2^(byte - 127)
    p = q.payload.numpy()
    nib = np.stack([p & 0xF, p >> 4], axis=-1).reshape(17, 128).astype(np.uint8)
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = np.exp2(q.scales.numpy().astype(np.float64) - 127).repeat(GROUP, axis=1)
    assert np.array_equal(vals * scale, w.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 7, 8192])
def test_linear_equals_the_dense_product(dtype, chunk_rows):
    w = quantize_mxfp4(torch.randn(50, 64, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = mxfp4_linear(x, w, chunk_rows=chunk_rows)
    ref = x.double() @ w.dequantize(dtype=torch.float64).T
    assert got.shape == (3, 5, 50) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # relative to the output's scale: float accumulation, bf16 output
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("w,msg", [
    (torch.zeros(4, 40), "divisible by 32"),
    (torch.zeros(64), "2-D"),
    (torch.zeros(2, 32, dtype=torch.int32), "2-D float"),
    (torch.tensor([[float("nan")] + [0.0] * 31]), "NaN or inf"),
])
def test_quantize_refuses(w, msg):
    with pytest.raises(KvxError, match=msg) as e:
        quantize_mxfp4(w)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_linear_refuses_bad_inputs():
    w = quantize_mxfp4(torch.randn(8, 32))
    for bad in (torch.zeros(2, 64), torch.zeros(2, 32, dtype=torch.int64), "x"):
        with pytest.raises(KvxError, match="x must be"):
            mxfp4_linear(bad, w)
    with pytest.raises(KvxError, match="chunk_rows"):
        mxfp4_linear(torch.zeros(2, 32), w, chunk_rows=0)
    with pytest.raises(KvxError, match="Mxfp4Weight"):
        mxfp4_linear(torch.zeros(2, 32), torch.zeros(8, 32))
    assert isinstance(w, Mxfp4Weight)
