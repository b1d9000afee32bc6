"""codec: QuantDesc <-> registry name for every format (hand table and round trip), and scale-pool
geometry checks when a descriptor's scale pools do not match its format."""
import dataclasses

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.codec import format_name, format_of, quant_desc
from kvx_core.descriptors import KvIoDesc, QuantDesc, SlotMapping, TensorDesc, WriteDesc
from kvx_core.enums import QUANT_FLAG_HADAMARD as HAD, QUANT_FLAG_MX_SCALE_FLOOR as FLOOR, DType, Layout, QuantFormat
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, list_formats
from kvx_core.ops.reference import write_kv

H, D, BS, N = 2, 64, 4, 3

# the descriptor fields each name is recorded with, by hand: (format, group size, flags)
RECORDED = {
    "fp8_e4m3": (QuantFormat.FP8_E4M3, D, 0), "fp8_e5m2": (QuantFormat.FP8_E5M2, D, 0),
    "int8": (QuantFormat.INT8, D, 0), "int4": (QuantFormat.INT4, D, 0), "int4_rot": (QuantFormat.INT4, D, HAD),
    "mxfp4": (QuantFormat.MXFP4, 16, 0), "mxfp4_32": (QuantFormat.MXFP4, 32, 0),
    "mxfp4_floor": (QuantFormat.MXFP4, 16, FLOOR), "mxfp4_32_floor": (QuantFormat.MXFP4, 32, FLOOR),
    "mxfp4_rot": (QuantFormat.MXFP4, 16, HAD), "mxfp4_32_rot": (QuantFormat.MXFP4, 32, HAD),
    "nvfp4": (QuantFormat.NVFP4, 16, 0), "nvfp4_rot": (QuantFormat.NVFP4, 16, HAD),
    "k8v4": (QuantFormat.K8V4, 16, 0), "k8v4_rot": (QuantFormat.K8V4, 16, HAD),
}
PLAIN = {"bf16", "fp16", "fp32"}


def _raises(status, fn, *args):
    with pytest.raises(KvxError) as e:
        fn(*args)
    assert e.value.status == status
    return e.value


def _cache(name: str) -> PagedKVCache:
    return PagedKVCache(name, num_layers=1, num_blocks=N, block_size=BS, num_kv_heads=H, head_dim=D)


def test_every_registry_name_is_covered():
    assert set(RECORDED) | PLAIN == set(list_formats())


@pytest.mark.parametrize("name", list_formats())
def test_quant_desc_round_trips_to_the_same_name(name):
    fmt, cache = get_format(name), _cache(name)
    desc = cache.descriptor(0)
    assert format_of(desc) is fmt
    p = cache.layers[0]
    q = quant_desc(fmt, D, p.k_scales, p.v_scales, p.k_global, p.v_global)
    if name in PLAIN:
        assert q is None and desc.quant is None
        return
    assert (q.format, q.group_size, q.flags) == RECORDED[name]
    assert format_name(q) == name and format_name(desc.quant) == name
    # a descriptor written by hand from the table decodes to the same name
    fmt_enum, group, flags = RECORDED[name]
    hand = QuantDesc(fmt_enum, group, q.k_data_dtype, q.v_data_dtype, None, None, flags=flags)
    assert format_name(hand) == name


def test_format_name_rejects_what_kvx_does_not_define():
    q = QuantDesc(QuantFormat.MXFP4, 64, DType.FP4_E2M1X2, DType.FP4_E2M1X2, None, None)
    _raises(Status.UNSUPPORTED, format_name, q)
    _raises(Status.UNSUPPORTED, format_name, dataclasses.replace(q, format=QuantFormat.NONE))
    # a name the descriptor can spell but the registry lacks is refused when the format is resolved
    cache = _cache("mxfp4_32_floor")
    d = cache.descriptor(0)
    bad = dataclasses.replace(d, quant=dataclasses.replace(d.quant, flags=FLOOR | HAD))
    assert format_name(bad.quant) == "mxfp4_32_floor_rot"
    _raises(Status.UNSUPPORTED, format_of, bad)


def _with_scales(desc, which: str, t: torch.Tensor | None):
    sd = None if t is None else TensorDesc.from_torch(t, Layout.HND)
    return dataclasses.replace(desc, quant=dataclasses.replace(desc.quant, **{f"{which}_scales": sd}))


def _write(desc) -> None:
    k = torch.randn(2, H, D)
    write_kv(desc, WriteDesc(KvIoDesc(k, k.clone()), SlotMapping(torch.tensor([0, 5]))))


@pytest.mark.parametrize("name", ["nvfp4", "int8", "mxfp4_32_rot", "k8v4"])
def test_scale_pool_shape_mismatch_is_invalid_argument(name):
    desc = _cache(name).descriptor(0)
    which = "v" if name == "k8v4" else "k"  # k8v4's FP8 keys have no scale pool
    width = getattr(get_format(name), which).scale_dim(D)
    for shape in ((N, H, BS, width + 1), (N, H, BS + 1, width), (N, H + 1, BS, width), (N, H, BS)):
        bad = _with_scales(desc, which, torch.zeros(shape, dtype=torch.uint8))
        e = _raises(Status.INVALID_ARGUMENT, format_of, bad)
        assert f"quant.{which}_scales" in e.message
        _raises(Status.INVALID_ARGUMENT, _write, bad)
    e = _raises(Status.INVALID_ARGUMENT, format_of, _with_scales(desc, which, None))
    assert "must be present" in e.message
    fewer = _with_scales(desc, which, torch.zeros(N - 1, H, BS, width, dtype=torch.uint8))
    _raises(Status.INVALID_ARGUMENT, fewer.validate)  # dual pools share block ids
    _write(desc)  # the untampered descriptor writes fine


@pytest.mark.parametrize("name", ["fp8_e4m3", "k8v4"])
def test_scale_pool_where_format_has_none_is_invalid_argument(name):
    desc = _cache(name).descriptor(0)
    extra = _with_scales(desc, "k", torch.zeros(N, H, BS, 4, dtype=torch.uint8))
    e = _raises(Status.INVALID_ARGUMENT, format_of, extra)
    assert "must be absent" in e.message
