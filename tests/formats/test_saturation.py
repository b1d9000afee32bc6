"""Finite inputs never encode as NaN (issue 10, F7): FP64 values beyond the FP32 range enter every quantized
format as +-FP32 max and saturate as each format's docstring says, instead of becoming inf in the FP32 cast
and poisoning their group with the NaN marker.

Oracle: the numpy/ml_dtypes re-implementations in oracles.py, fed the input clipped to +-FP32 max by
numpy (nothing from kvx_core computes the expected bytes); plus the saturation values the docstrings pin.
Non-finite inputs must still poison their group (the clip must not make inf finite). The last section covers
the format API's other arguments (out_dtype, constructor arguments, helpers): KvxError, never a TypeError.
"""
import numpy as np
import pytest
import torch

from kvx_adapters.lmdeploy import kv_cache_format_name
from kvx_core.errors import KvxError, Status
from kvx_core.formats import (
    FP8Format,
    IdentityFormat,
    IntFormat,
    MXFP4Format,
    NVFP4Format,
    get_format,
    global_scale_from_amax,
    list_formats,
    rotate,
)

from . import oracles as O

F32 = np.float32
F32_MAX = float(np.finfo(F32).max)
HUGE = (1e300, -1e39, 3.5e38, -1.7e308, F32_MAX * (1 + 2.0 ** -20), 1e39)
TINY = (1e-300, 5e-324, -1e-46)
G = np.array([0.5, 3.0], dtype=F32)  # per-KV-head global scale (H = 2)


def _oracle(fmt, x32: np.ndarray, g) -> tuple[np.ndarray, np.ndarray]:
    """(payload bytes, scale bytes) the numpy oracle gives for FP32 input `x32`."""
    if isinstance(fmt, FP8Format):
        return O.fp8_encode(x32, fmt.name, g), np.zeros(x32.shape[:-1] + (0,), np.uint8)
    if isinstance(fmt, IntFormat):
        return O.int_encode(x32, fmt.bits)[:2]
    if isinstance(fmt, NVFP4Format):
        return O.nvfp4_encode(x32, g)
    return O.mxfp4_encode(x32, fmt.group_size, fmt.scale_rule)


def _oracle_decode(fmt, payload: np.ndarray, sbytes: np.ndarray, g) -> np.ndarray:
    if isinstance(fmt, FP8Format):
        dt, _ = O.FP8[fmt.name]
        return (payload.view(dt).astype(F32) * O._gscale(g, payload.shape[-2])).astype(F32)
    if isinstance(fmt, IntFormat):
        return O.int_decode(payload, sbytes, fmt.bits)
    if isinstance(fmt, NVFP4Format):
        return O.nvfp4_decode(payload, sbytes, g)
    return O.mxfp4_decode(payload, sbytes, fmt.group_size)


QUANTIZED = [FP8Format("fp8_e4m3"), FP8Format("fp8_e5m2"), IntFormat(8), IntFormat(4), NVFP4Format(),
             MXFP4Format(16, "rceil"), MXFP4Format(32, "rceil"), MXFP4Format(16, "floor"), MXFP4Format(32, "floor")]


def _clip_f32(x64: np.ndarray) -> np.ndarray:
    """The documented rule, computed by numpy: finite values clipped to +-FP32 max, then cast."""
    with np.errstate(over="ignore"):
        return np.where(np.isfinite(x64), np.clip(x64, -F32_MAX, F32_MAX), x64).astype(F32)


def _uses_g(fmt) -> bool:
    return fmt.uses_global_scale


def _mixed_fp64(seed: int) -> np.ndarray:
    """[4, 2, 64] FP64 values: normal data with huge finite values (beyond FP32) and tiny ones sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 2, 64)) * 3.0
    flat = x.reshape(-1)
    pos = rng.choice(flat.size, size=len(HUGE) + len(TINY), replace=False)
    flat[pos] = HUGE + TINY
    x[3, 1, :] = 1e300  # a whole row (and group) beyond the FP32 range
    return x


def _check_no_nan_decode(fmt, payload: np.ndarray, sbytes: np.ndarray, dec: np.ndarray) -> None:
    """A finite input decodes without NaN; inf only where MXFP4 RCEIL's documented decode overflow applies
    (scale exponent 126, |e2m1| >= 4: 4 * 2**126 = 2**128)."""
    assert not np.isnan(dec).any(), np.argwhere(np.isnan(dec))[:5]
    inf = np.isinf(dec)
    if isinstance(fmt, MXFP4Format) and fmt.scale_rule == "rceil":
        byte = np.repeat(sbytes, fmt.group_size, axis=-1)
        mag = np.abs(O.E2M1_LUT[O.unpack(payload)])
        assert not (inf & ~((byte == 127 + 126) & (mag >= 4))).any()
    else:
        assert not inf.any(), np.argwhere(inf)[:5]


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_fp64_beyond_fp32_range_matches_oracle_of_clipped_input(fmt, seed):
    x64 = _mixed_fp64(seed)
    g = G if _uses_g(fmt) else None
    payload, sbytes = fmt.encode(torch.from_numpy(x64), None if g is None else torch.from_numpy(g))
    payload = payload.view(torch.uint8).numpy()
    sbytes = sbytes.numpy()
    op, os_ = _oracle(fmt, _clip_f32(x64), g)
    assert np.array_equal(payload, op), np.argwhere(payload != op)[:5]
    assert np.array_equal(sbytes, os_), np.argwhere(sbytes != os_)[:5]
    dec = fmt.decode(torch.from_numpy(payload).view(fmt.torch_data_dtype), torch.from_numpy(sbytes),
                     None if g is None else torch.from_numpy(g)).numpy()
    O.assert_same_float(dec, _oracle_decode(fmt, op, os_, g))
    _check_no_nan_decode(fmt, op, os_, dec)


@pytest.mark.parametrize("fmt, expected", [
    (FP8Format("fp8_e4m3"), 448.0), (FP8Format("fp8_e5m2"), 57344.0),
    (NVFP4Format(), 6.0 * 448.0),  # group scale saturates at 448 (byte 0x7E), element at E2M1 6
    (MXFP4Format(16, "floor"), 6.0 * 2.0 ** 125),  # E = floor(log2(FP32 max)) - 2 = 125, element 6
    (IntFormat(8), 255 * 65504.0), (IntFormat(4), 15 * 65504.0),  # fp16 scale saturates at 65504, min 0
])
def test_huge_finite_values_saturate_to_the_documented_extreme(fmt, expected):
    x = torch.zeros(1, 1, 32, dtype=torch.float64)
    x[..., 1] = 1e300
    payload, scales = fmt.encode(x)
    dec = fmt.decode(payload, scales)
    assert float(dec[0, 0, 1]) == expected
    assert float(dec[0, 0, 0]) == 0.0 and torch.isfinite(dec).all()


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_non_finite_fp64_still_poisons_its_group(fmt, bad):
    """The clip keeps NaN/inf: their encoding equals the FP32 input's, the documented NaN marker."""
    x64 = _mixed_fp64(2)
    x64[1, 0, 5] = bad
    g = G if _uses_g(fmt) else None
    gt = None if g is None else torch.from_numpy(g)
    p64, s64 = fmt.encode(torch.from_numpy(x64), gt)
    op, os_ = _oracle(fmt, _clip_f32(x64), g)
    assert np.array_equal(p64.view(torch.uint8).numpy(), op) and np.array_equal(s64.numpy(), os_)
    dec = fmt.decode(p64, s64, gt)
    assert torch.isnan(dec[1, 0]).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_each_input_dtype_at_its_extremes_encodes_finite(fmt, dtype):
    """Rows holding +-max and the smallest subnormal of the input dtype (INT: max - min overflows FP32)."""
    fi = torch.finfo(dtype)
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 0, ::2], x[0, 0, 1::2] = fi.max, -fi.max
    x[1, 1, :16] = fi.max
    x[2, 0, 3], x[2, 1, 4] = fi.smallest_normal * 2.0 ** -3, -fi.tiny
    g = G if _uses_g(fmt) else None
    payload, sbytes = fmt.encode(x, None if g is None else torch.from_numpy(g))
    op, os_ = _oracle(fmt, x.float().numpy(), g)
    assert np.array_equal(payload.view(torch.uint8).numpy(), op) and np.array_equal(sbytes.numpy(), os_)
    dec = fmt.decode(payload, sbytes, None if g is None else torch.from_numpy(g)).numpy()
    _check_no_nan_decode(fmt, op, os_, dec)


QUANTIZED_CACHE_FORMATS = [n for n in list_formats() if get_format(n).quant.name != "NONE"]


@pytest.mark.parametrize("name", QUANTIZED_CACHE_FORMATS)
def test_cache_formats_encode_huge_fp64_finite(name):
    """Through the cache-format API (K and V, `_rot` and k8v4 included): no NaN marker from finite input,
    and the bytes equal the tensor format's encoding of the (rotated) input clipped by numpy."""
    f = get_format(name)
    x64 = torch.from_numpy(_mixed_fp64(4))
    for tf, enc in ((f.k, f.encode_k), (f.v, f.encode_v)):
        payload, scales = enc(x64)
        stored = rotate(x64) if f.rotate else x64
        assert stored.dtype == torch.float64 and torch.isfinite(stored).all()
        want_p, want_s = tf.encode(torch.from_numpy(_clip_f32(stored.numpy())))
        assert torch.equal(payload.view(torch.uint8), want_p.view(torch.uint8)) and torch.equal(scales, want_s)
        _check_no_nan_decode(tf, payload.view(torch.uint8).numpy(), scales.numpy(), tf.decode(payload, scales).numpy())


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_identity_formats_store_the_ieee_cast(name):
    """Pinned in identity.py: unquantized formats do not saturate, they store torch's cast (+-inf beyond range)."""
    fmt = IdentityFormat(name)
    x64 = torch.from_numpy(_mixed_fp64(5))
    payload, _ = fmt.encode(x64)
    assert torch.equal(payload, x64.to(fmt.torch_data_dtype))
    assert torch.isinf(payload[3, 1]).all()


# ------------------------------------------------------------ neighbours: the format API's other arguments
X = torch.randn(2, 2, 32)


@pytest.mark.parametrize("name", ["nvfp4", "int4", "fp8_e4m3", "mxfp4_32_floor", "bf16", "k8v4_rot"])
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.uint8, torch.bool, "float32", None])
def test_decode_refuses_non_float_out_dtype(name, out_dtype):
    """Decoded values are floats (NaN marks a poisoned group); an int out_dtype would hide it."""
    f = get_format(name)
    k, v = f.encode_k(X), f.encode_v(X)
    for decode, stored in ((f.k.decode, k), (f.decode_k, k), (f.v.decode, v), (f.decode_v, v)):
        with pytest.raises(KvxError) as e:
            decode(*stored, out_dtype=out_dtype)
        assert e.value.status == Status.INVALID_ARGUMENT


BAD_FORMAT_CALLS = {
    "fp8_name_list": lambda: FP8Format(["fp8_e4m3"]), "identity_name_list": lambda: IdentityFormat(["bf16"]),
    "int_bits_float": lambda: IntFormat(8.0), "int_bits_bool": lambda: IntFormat(True),
    "int_bits_str": lambda: IntFormat("8"), "mx_group_float": lambda: MXFP4Format(16.0),
    "mx_group_bool": lambda: MXFP4Format(True), "mx_rule_list": lambda: MXFP4Format(16, ["rceil"]),
    "amax_float": lambda: global_scale_from_amax(3.0),
    "amax_int_tensor": lambda: global_scale_from_amax(torch.tensor(3)),
    "scale_exponent_list": lambda: MXFP4Format().scale_exponent([1.0]),
    "unrotate_str": lambda: get_format("nvfp4").decode_v(*get_format("nvfp4").encode_v(X), unrotate="yes"),
    "meta_global_scale": lambda: get_format("nvfp4").k.encode(X, torch.ones(1, device="meta")),
    "model_dtype_list": lambda: kv_cache_format_name(0, 90, [torch.bfloat16]),
    "policy_bool": lambda: kv_cache_format_name(True, 90),
    "head_dim_bool": lambda: get_format("int4").check_head_dim(True),
}


@pytest.mark.parametrize("call", BAD_FORMAT_CALLS.values(), ids=BAD_FORMAT_CALLS.keys())
def test_format_constructors_and_helpers_raise_kvx_errors(call):
    with pytest.raises(KvxError):
        call()


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_identity_encode_and_decode_never_alias(name):
    """The payload is a copy of the input (not the caller's tensor, no autograd history) and decode returns a
    copy of the payload: writing into one never changes the other."""
    fmt = IdentityFormat(name)
    x = torch.randn(2, 2, 32, dtype=fmt.torch_data_dtype, requires_grad=True)
    payload, scales = fmt.encode(x)
    assert not payload.requires_grad and payload.data_ptr() != x.data_ptr()
    out = fmt.decode(payload, scales, out_dtype=fmt.torch_data_dtype)
    assert out.data_ptr() != payload.data_ptr()
    before = payload.clone()
    out.zero_()
    assert torch.equal(payload, before)
