"""MXFP4 lm_head weights (kvx_core/mxfp4_linear.py): the codec is the formats' MXFP4 (group 32), exact on
representable weights, checked against ml_dtypes' float4_e2m1fn decoding, finite near the FP32 maximum; the chunked
product agrees with the dense one within the FP32 summation bound; malformed weights are refused."""
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


FP32_MAX = float(np.finfo(np.float32).max)


def _decode_oracle(q: Mxfp4Weight) -> np.ndarray:
    """Independent decode (float64): nibbles through ml_dtypes' float4_e2m1fn, scales as 2^(byte - 127)."""
    p = q.payload.numpy()
    rows = p.shape[0]
    nib = np.stack([p & 0xF, p >> 4], axis=-1).reshape(rows, -1).astype(np.uint8)
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return vals * np.exp2(q.scales.numpy().astype(np.float64) - 127).repeat(GROUP, axis=1)


def test_weights_near_the_fp32_maximum_decode_finite():
    """RCEIL gives a group of amax > 6 * 2**125 the scale 2**126, and 4 * 2**126 = 2**128 overflows FP32: the weight
    quantizer uses OCP MX's scale there, 2**(floor(log2(amax)) - 2) = 2**125, elements RNE saturating at 6.
    Hand-made expectation: FP32 max / 2**125 = 7.99.. -> 6, -3e38 / 2**125 = -7.05 -> -6, 1.6e38 -> 3.76 -> 4,
    1e38 -> 2.35 -> 2, and a second group far from the maximum keeps RCEIL's scale."""
    w = torch.zeros(1, 64)
    w[0, :4] = torch.tensor([FP32_MAX, -3e38, 1.6e38, 1e38])
    w[0, 32:34] = torch.tensor([5.0, -1.0])  # RCEIL: 2**ceil(log2(5 / 6)) = 1, elements 5 -> 4 (RNE tie to even), -1
    q = quantize_mxfp4(w)
    want = np.zeros(64)
    want[:4] = np.array([6.0, -6.0, 4.0, 2.0]) * 2.0 ** 125
    want[32:34] = [4.0, -1.0]
    assert q.scales.tolist() == [[127 + 125, 127 + 0]]
    assert np.array_equal(_decode_oracle(q)[0], want)
    assert torch.equal(q.dequantize().double()[0], torch.from_numpy(want))  # finite in FP32 too


def test_no_finite_weight_decodes_to_inf():
    g = torch.Generator().manual_seed(5)
    w = (torch.rand(64, 128, generator=g) * 2 - 1) * FP32_MAX  # every group's amax within 2% of the maximum or so
    w[::2] *= 0.76  # and groups around 6 * 2**125, the RCEIL boundary
    q = quantize_mxfp4(w)
    assert torch.isfinite(q.dequantize()).all() and q.max_scale <= 127 + 125
    dec = _decode_oracle(q)
    assert np.isfinite(dec).all()
    # each element within half an E2M1 step of its group's scale, or saturated at 6 * scale
    scale = np.exp2(q.scales.numpy().astype(np.float64) - 127).repeat(GROUP, axis=1)
    x = w.double().numpy()
    assert (np.abs(dec - x) <= np.maximum(scale, np.abs(x) - 6 * scale) + 1e-300).all()


@pytest.mark.parametrize("payload, scales, max_scale, words", [
    (torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), None, "payload [out, in / 2]"),  # 1-D
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), None, "scales [out, in / 32]"),
    (torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), None, "in a multiple of 32"),
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), None, "uint8"),
    (torch.zeros(2, 16, dtype=torch.uint8), [[0], [0]], None, "list"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 130, dtype=torch.uint8), 127, "max_scale 127"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 127, dtype=torch.uint8), 127.0, "max_scale 127.0"),
])
def test_malformed_weights_are_refused(payload, scales, max_scale, words):
    with pytest.raises(KvxError) as e:
        Mxfp4Weight(payload, scales, max_scale)
    assert e.value.status == Status.INVALID_ARGUMENT and words in e.value.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_rows_change_only_the_summation_order(dtype):
    """The promise `mxfp4_linear` states: any two `chunk_rows` agree within the FP32 summation bound
    2 * K * 2**-24 * sum|x * w| per output, plus one rounding to x's dtype each (they do differ in the last bits:
    the BLAS picks its order by shape)."""
    k = 2880
    w = quantize_mxfp4(torch.randn(300, k, generator=torch.Generator().manual_seed(6)))
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    mag = x.double().abs() @ w.dequantize(dtype=torch.float64).abs().T  # sum |x * w|, float64
    outs = [mxfp4_linear(x, w, chunk_rows=c).double() for c in (1, 7, 64, 8192)]
    eps = torch.finfo(dtype).eps
    for a in outs[1:]:
        bound = 2 * k * 2.0 ** -24 * mag + eps * (a.abs() + outs[0].abs())
        assert ((a - outs[0]).abs() <= bound).all()
