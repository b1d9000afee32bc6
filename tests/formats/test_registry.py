"""Cache-format registry and Hadamard rotation."""
import math

import pytest
import torch

from kvx_core.enums import QUANT_FLAG_HADAMARD, QUANT_FLAG_MX_SCALE_FLOOR, DType, QuantFormat, torch_dtype
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, hadamard, list_formats, rotate

NAMES = ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "mxfp4", "mxfp4_32", "nvfp4", "k8v4",
         "mxfp4_floor", "mxfp4_32_floor", "int4_rot", "mxfp4_rot", "mxfp4_32_rot", "nvfp4_rot", "k8v4_rot"]


def test_every_name_listed_and_resolvable():
    assert sorted(list_formats()) == sorted(NAMES)
    for name in NAMES:
        f = get_format(name)
        assert f.name == name and f.rotate == name.endswith("_rot")
        floor = QUANT_FLAG_MX_SCALE_FLOOR if name.endswith("_floor") else 0
        assert f.flags == (QUANT_FLAG_HADAMARD if f.rotate else 0) | floor


def test_unknown_name_lists_valid_names():
    with pytest.raises(KvxError) as e:
        get_format("nvfp8")
    assert e.value.status == Status.UNSUPPORTED
    for name in NAMES:
        assert name in e.value.message
    with pytest.raises(KvxError):
        get_format(None)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bytes_per_element(d):
    want = {
        "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": (d + 4) / d,
        "int4": (d / 2 + 4) / d, "mxfp4": 0.5625, "mxfp4_32": 0.53125, "nvfp4": 0.5625,
        "mxfp4_floor": 0.5625, "mxfp4_32_floor": 0.53125,
    }
    for name in NAMES:
        f = get_format(name)
        base = name.removesuffix("_rot")
        if base == "k8v4":
            assert f.k.bytes_per_element(d) == 1 and f.v.bytes_per_element(d) == 0.5625
            continue
        assert f.k.bytes_per_element(d) == want[base] and f.v.bytes_per_element(d) == want[base]
        assert f.bytes_per_token_head(d) == 2 * want[base] * d


def test_tensor_format_attributes():
    exp = {  # name: (k.name, quant, data dtype, scale dtype, group_size, uses global scale)
        "bf16": ("bf16", QuantFormat.NONE, DType.BF16, None, 0, False),
        "fp8_e5m2": ("fp8_e5m2", QuantFormat.FP8_E5M2, DType.F8_E5M2, None, 0, True),
        "int8": ("int8", QuantFormat.INT8, DType.U8, DType.U8, -1, False),
        "int4": ("int4", QuantFormat.INT4, DType.INT4X2, DType.U8, -1, False),
        "mxfp4": ("mxfp4_16", QuantFormat.MXFP4, DType.FP4_E2M1X2, DType.UE8M0, 16, False),
        "mxfp4_32": ("mxfp4_32", QuantFormat.MXFP4, DType.FP4_E2M1X2, DType.UE8M0, 32, False),
        "nvfp4": ("nvfp4", QuantFormat.NVFP4, DType.FP4_E2M1X2, DType.F8_E4M3, 16, True),
    }
    for name, (kname, quant, dt, sdt, gs, ug) in exp.items():
        k = get_format(name).k
        assert (k.name, k.quant, k.data_dtype, k.scale_dtype, k.group_size, k.uses_global_scale) == (
            kname, quant, dt, sdt, gs, ug)
        assert k.torch_data_dtype == torch_dtype(dt)
    assert get_format("k8v4").quant == QuantFormat.K8V4 and get_format("k8v4_rot").quant == QuantFormat.K8V4
    assert get_format("nvfp4_rot").quant == QuantFormat.NVFP4
    assert get_format("int4").k.group_len(96) == 96 and get_format("mxfp4").k.groups_per_token_head(128) == 8


@pytest.mark.parametrize("name", NAMES)
def test_every_format_round_trips_shapes(name):
    f = get_format(name)
    x = torch.randn(3, 5, 2, 64)  # extra leading dims are allowed
    for tf in (f.k, f.v):
        p, s = tf.encode(x)
        assert p.dtype == tf.torch_data_dtype and p.shape == (3, 5, 2, tf.payload_dim(64))
        assert s.dtype == torch.uint8 and s.shape == (3, 5, 2, tf.scale_dim(64))
        y = tf.decode(p, s, out_dtype=torch.bfloat16)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        assert (y.float() - x).abs().max() < 1.5  # loose: formats' own tests hold the exact bounds


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
def test_hadamard_orthonormal_symmetric(d):
    h = hadamard(d, torch.float64)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.all(h.abs() == 1 / math.sqrt(d))
    assert torch.all(h[0] > 0) and torch.all(h[:, 0] > 0)  # Sylvester: first row/col all +


def test_hadamard_sylvester_entries():
    h = hadamard(8, torch.float64) * math.sqrt(8)
    for i in range(8):
        for j in range(8):
            assert h[i, j] == (-1) ** bin(i & j).count("1")


@pytest.mark.parametrize("d", [0, 3, 48, 96, -4])
def test_hadamard_rejects_non_power_of_two(d):
    with pytest.raises(KvxError) as e:
        hadamard(d)
    assert e.value.status == Status.UNSUPPORTED
    if d > 0:
        with pytest.raises(KvxError):
            get_format("nvfp4_rot").check_head_dim(d if d % 16 == 0 else 48)


def test_rotation_preserves_qk_and_round_trips_v():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 2, 128, dtype=torch.float64).unbind(0)
    assert torch.allclose(rotate(q) @ rotate(k).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-10)
    assert torch.allclose(rotate(rotate(v)), v, atol=1e-12)
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    assert torch.allclose(rotate(p @ rotate(v)), p @ v, atol=1e-12)  # output rotated back
    assert rotate(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_rotated_cache_format_helpers():
    torch.manual_seed(1)
    f = get_format("nvfp4_rot")
    q, k, v = torch.randn(3, 16, 2, 128).unbind(0)
    kp, ks = f.encode_k(k)
    vp, vs = f.encode_v(v)
    # stored keys/values are the codec applied to the rotated tensors
    assert torch.equal(kp, f.k.encode(rotate(k))[0]) and torch.equal(vs, f.v.encode(rotate(v))[1])
    ref = q @ k.transpose(-1, -2)
    scores = f.rotate_q(q) @ f.decode_k(kp, ks).transpose(-1, -2)
    assert (scores - ref).abs().max() < 0.2 * ref.abs().max()
    p = torch.softmax(ref, -1)
    o = f.unrotate_output(p @ f.decode_v(vp, vs))
    assert torch.allclose(o, p @ f.decode_v(vp, vs, unrotate=True), atol=1e-4)
    assert get_format("k8v4_rot").rotate_q(q).shape == q.shape
    assert torch.equal(get_format("nvfp4").rotate_q(q), q)


def test_rotation_helps_int4_with_outlier_channels():
    """Per-token-head INT4 range is set by outlier channels; rotation spreads them over the head."""
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 64, 2, 128).unbind(0)
    k[..., 5] *= 40
    v[..., 9] *= 40
    rot, plain = get_format("int4_rot"), get_format("int4")
    ref = q @ k.transpose(-1, -2)
    err_rot = (rot.rotate_q(q) @ rot.decode_k(*rot.encode_k(k)).transpose(-1, -2) - ref).abs().mean()
    err_plain = (q @ plain.decode_k(*plain.encode_k(k)).transpose(-1, -2) - ref).abs().mean()
    assert err_rot < 0.5 * err_plain
    v_rot = rot.decode_v(*rot.encode_v(v), unrotate=True)
    v_plain = plain.decode_v(*plain.encode_v(v))
    assert (v_rot - v).abs().mean() < 0.5 * (v_plain - v).abs().mean()


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "int4", "mxfp4", "mxfp4_32", "nvfp4"])
def test_decode_strided_views(name):
    """Pools are strided views (HND vs NHD): decoding a non-contiguous view equals decoding a copy."""
    tf = get_format(name).k
    x = torch.randn(2, 7, 64)  # [H, T, D]
    p, s = tf.encode(x)
    pv, sv = p.transpose(0, 1), s.transpose(0, 1)  # [T, H, ...] views
    assert not pv.is_contiguous()
    assert torch.equal(tf.decode(pv, sv), tf.decode(pv.contiguous(), sv.contiguous()))
    assert torch.equal(tf.decode(pv, sv), tf.decode(p, s).transpose(0, 1))
