"""Adversarial regressions for descriptors and the C ABI (issue 10, findings F2, F3, F10).

F2: K data, V data, K scales, V scales (and global scales) may not share a byte; interleaved strided
views of one page buffer still validate. F3: every descriptor field is checked against its type, its C
field and the tensor it describes; enum fields given as plain ints (as C passes them) are coerced or
refused. F10: no value is stored in a C field that cannot hold it.

Oracles are independent of the code under test: byte sets enumerated by brute force, pools
snapshotted with clone() before a rejected call, values read back from the ctypes structs.
"""
from __future__ import annotations

import ctypes
import dataclasses
import random
import time

import pytest
import torch

from kvx_core import abi, block_tables as bt, layouts
from kvx_core.cache import PagedKVCache, page_bytes, page_regions
from kvx_core.descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    PoolDesc,
    ScaleDesc,
    SeqLens,
    SlotMapping,
    TensorDesc,
    WriteDesc,
    memory_of,
)
from kvx_core.enums import DType, Layout, Memory, QuantFormat, ScaleGranularity
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, list_formats
from kvx_core.layouts import tensors_overlap
from kvx_core.ops import dispatch, reference

INV = Status.INVALID_ARGUMENT
N, B, H, D = 4, 4, 2, 8
rep = dataclasses.replace
WRITERS = [reference.write_kv, dispatch.write_kv]
GATHERERS = [reference.gather_kv, dispatch.gather_kv]


def refused(fn, status=INV, *words: str) -> KvxError:
    """`fn()` raises KvxError of `status` (never another exception type) whose message has `words`."""
    with pytest.raises(KvxError) as ei:
        fn()
    assert ei.value.status == status, ei.value
    for w in words:
        assert w in ei.value.message, ei.value.message
    return ei.value


def plain_cache(dtype=torch.float32) -> CacheDesc:
    return CacheDesc.from_torch(torch.zeros(N, B, H, D, dtype=dtype), torch.zeros(N, B, H, D, dtype=dtype),
                                block_size=B, num_kv_heads=H, head_dim=D, k_layout=Layout.NHD, v_layout=Layout.NHD)


def quant_cache(fmt: str, page_buffer: bool = False) -> CacheDesc:
    return PagedKVCache(fmt, num_layers=1, num_blocks=N, block_size=B, num_kv_heads=H, head_dim=32,
                        page_buffer=page_buffer).descriptor(0)


def touched(t: torch.Tensor) -> set[int]:
    """Every byte address `t` touches, by enumeration (the oracle for tensors_overlap)."""
    if t.numel() == 0:
        return set()
    es, idx = t.element_size(), torch.zeros(1, dtype=torch.int64)
    for n, s in zip(t.shape, t.stride(), strict=True):
        idx = (idx[:, None] + torch.arange(n) * s * es).reshape(-1)
    return set((idx[:, None] + torch.arange(es)).reshape(-1).add(t.data_ptr()).tolist())


def io(tokens: int, d: int = D) -> KvIoDesc:
    return KvIoDesc(torch.randn(tokens, H, d), torch.randn(tokens, H, d))


# =============================================================================== F2: overlapping memory
def test_k_and_v_overlapping_by_a_block_are_refused():
    """The issue's reproducer: `from_torch(buf[:4], buf[1:])`; a V write would land in K of another slot."""
    buf = torch.zeros(N + 1, B, H, D)
    refused(lambda: CacheDesc.from_torch(buf[:N], buf[1:], block_size=B, num_kv_heads=H, head_dim=D),
            INV, "cache.k", "cache.v", "overlap")


@pytest.mark.parametrize("shift", [1, B * H * D - 1, -(B * H * D), 1 - N * B * H * D])
def test_k_and_v_overlapping_by_any_amount_are_refused(shift):
    """One shared element at either end, or a whole block, is enough (element shifts of a flat buffer)."""
    total = N * B * H * D
    flat = torch.zeros(total + abs(shift))
    k0, v0 = (0, shift) if shift > 0 else (-shift, 0)
    k, v = flat[k0:k0 + total].view(N, B, H, D), flat[v0:v0 + total].view(N, B, H, D)
    refused(lambda: CacheDesc.from_torch(k, v, block_size=B, num_kv_heads=H, head_dim=D), INV, "overlap")


def test_k_and_v_adjacent_are_accepted():
    buf = torch.zeros(2 * N, B, H, D)
    CacheDesc.from_torch(buf[:N], buf[N:], block_size=B, num_kv_heads=H, head_dim=D).validate()


@pytest.mark.parametrize("write", WRITERS, ids=["reference", "dispatch"])
def test_rejected_overlapping_write_changes_nothing(write):
    buf = torch.randn(N + 1, B, H, D)
    cache = CacheDesc.from_torch(buf[:N], buf[1:], block_size=B, num_kv_heads=H, head_dim=D, validate=False)
    before = buf.clone()
    refused(lambda: write(cache, WriteDesc(io(2), SlotMapping(torch.tensor([0, 5])))), INV, "overlap")
    assert torch.equal(buf, before)


def _quant_tensors(cache: CacheDesc) -> dict[str, torch.Tensor]:
    q = cache.quant
    out = {"k": cache.k.tensor, "v": cache.v.tensor}
    out.update({name: getattr(q, name).tensor for name in ("k_scales", "v_scales") if getattr(q, name) is not None})
    return out


SCALED = [f for f in list_formats() if get_format(f).k.scale_dim(32) or get_format(f).v.scale_dim(32)]
SCALE_CASES = [(f, s, victim) for f in SCALED for s in ("k_scales", "v_scales")
               for victim in ("k", "v", "k_scales", "v_scales")
               if s != victim and s in _quant_tensors(quant_cache(f)) and victim in _quant_tensors(quant_cache(f))]


@pytest.mark.parametrize("fmt,scale,victim", SCALE_CASES)
def test_scale_pool_over_another_region_is_refused(fmt, scale, victim):
    """A scale pool viewing the bytes of a data pool or of the other scale pool (e.g. quant.k_scales over V)."""
    cache = quant_cache(fmt)
    good = getattr(cache.quant, scale)
    raw = _quant_tensors(cache)[victim].reshape(-1).view(torch.uint8)
    bad_t = raw[:good.tensor.numel()].view(good.tensor.dtype).view(good.tensor.shape)
    bad = rep(cache, quant=rep(cache.quant, **{scale: TensorDesc.from_torch(bad_t, good.layout, good.dtype)}))
    refused(bad.validate, INV, f"quant.{scale}", "overlap")
    pools = {k: t.clone() for k, t in _quant_tensors(bad).items()}
    for write in WRITERS:
        refused(lambda: write(bad, WriteDesc(io(1, 32), SlotMapping(torch.tensor([3])))), INV)
    assert all(torch.equal(t, pools[k]) for k, t in _quant_tensors(bad).items())


@pytest.mark.parametrize("which", ["k_global_scale", "v_global_scale"])
def test_global_scale_over_a_pool_is_refused(which):
    cache = quant_cache("nvfp4")
    g = cache.v.tensor.reshape(-1).view(torch.uint8)[:4].view(torch.float32)
    refused(lambda: rep(cache, quant=rep(cache.quant, **{which: g})).validate(), INV, f"quant.{which}", "cache.v")


@pytest.mark.parametrize("fmt", list_formats())
def test_page_buffer_views_validate_and_are_disjoint(fmt):
    """vLLM-style pages: K, V and scales are strided regions of ONE buffer; exact, they validate."""
    cache = quant_cache(fmt, page_buffer=True)
    cache.validate()
    regions = [touched(t) for t in cache.written_regions().values()]
    assert all(not (a & b) for i, a in enumerate(regions) for b in regions[i + 1:])


def test_page_regions_shifted_by_one_byte_are_refused():
    """Each region of a page one byte earlier than its slot: it now reaches the previous region's last byte."""
    fmt = get_format("int8")
    regions = page_regions(fmt, B, H, 32)
    buf = torch.zeros(N, page_bytes(fmt, B, H, 32), dtype=torch.uint8)

    def view(off: int, n: int, x: int) -> torch.Tensor:
        return buf[:, off:off + n].view(N, H, B, x)

    (ko, kn), (vo, vn), (kso, ksn), (vso, vsn) = regions
    ok = CacheDesc.from_torch(view(ko, kn, 32), view(vo, vn, 32), block_size=B, num_kv_heads=H, head_dim=32,
                              k_layout=Layout.HND, v_layout=Layout.HND, quant=quant_cache("int8").quant, validate=False)
    scales = dict(k_scales=TensorDesc.from_torch(view(kso, ksn, 4), Layout.HND, DType.U8),
                  v_scales=TensorDesc.from_torch(view(vso, vsn, 4), Layout.HND, DType.U8))
    good = rep(ok, quant=rep(ok.quant, **scales))
    good.validate()
    k_end = ko + kn  # V one byte into K's last byte; a scale pool one byte into the data before it
    shifted_v = rep(good, v=TensorDesc.from_torch(view(k_end - 1, vn, 32), Layout.HND, good.v.dtype))
    refused(shifted_v.validate, INV, "cache.k", "cache.v")
    shifted_s = rep(good, quant=rep(good.quant, k_scales=TensorDesc.from_torch(
        view(vo + vn - 1, ksn, 4), Layout.HND, DType.U8)))
    refused(shifted_s.validate, INV, "cache.v", "quant.k_scales")


def test_interleaved_views_validate_and_element_shift_is_refused():
    """FlashInfer `[N, 2, ...]` K/V and even/odd element interleaves are disjoint; shifting V by one
    element (stride 2) makes it overlap K."""
    kv = torch.zeros(N, 2, B, H, D)
    CacheDesc.from_torch(kv[:, 0], kv[:, 1], block_size=B, num_kv_heads=H, head_dim=D).validate()
    base = torch.zeros(N, B, H, 2 * D + 2)
    CacheDesc.from_torch(base[..., 0:2 * D:2], base[..., 1:2 * D:2], block_size=B, num_kv_heads=H, head_dim=D,
                         k_layout=Layout.CUSTOM, v_layout=Layout.CUSTOM).validate()
    refused(lambda: CacheDesc.from_torch(base[..., 0:2 * D:2], base[..., 2:2 * D + 2:2], block_size=B,
                                         num_kv_heads=H, head_dim=D, k_layout=Layout.CUSTOM,
                                         v_layout=Layout.CUSTOM), INV, "overlap")


def test_one_pool_for_k_and_v_only_with_a_pool_descriptor():
    """TRT-LLM KVBlockArray: K and V are one pool told apart by KV_OFFSETS (needs cache.pool); a pool
    view shifted by one element is still refused."""
    base = torch.zeros(N * H * B * D + 1)
    pool, shifted = base[:-1].view(N, H, B, D), base[1:].view(N, H, B, D)
    pd = PoolDesc(memory_of(pool), pool[0].numel() * pool.element_size(), pool)
    CacheDesc.from_torch(pool, pool, block_size=B, num_kv_heads=H, head_dim=D, pool=pd).validate()
    refused(lambda: CacheDesc.from_torch(pool, pool, block_size=B, num_kv_heads=H, head_dim=D), INV, "overlap")
    refused(lambda: CacheDesc.from_torch(pool, shifted, block_size=B, num_kv_heads=H, head_dim=D, pool=pd),
            INV, "overlap")


def _random_view(buf: torch.Tensor, rng: random.Random) -> torch.Tensor | None:
    dtype = rng.choice([torch.uint8, torch.float16, torch.float32, torch.float64])
    es = torch.empty((), dtype=dtype).element_size()
    nel = buf.numel() // es
    shape = [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
    stride = [rng.choice([0, 1, 2, 3, 5, 8, 16, 24, 48]) for _ in shape]
    span = sum(max(n - 1, 0) * s for n, s in zip(shape, stride, strict=True)) + 1
    if span > nel:
        return None
    return buf[:nel * es].view(dtype).as_strided(shape, stride, rng.randint(0, nel - span))


def test_tensors_overlap_is_exact_against_enumerated_bytes(monkeypatch):
    """Random strided views of one buffer (any dtype, zero and interleaving strides, empty dims): the
    answer equals the intersection of the enumerated byte sets; a tiny chunk exercises the chunked walk."""
    monkeypatch.setattr(layouts, "_CHUNK", 3)
    layouts._lattices_meet.cache_clear()
    rng, buf, checked = random.Random(10), torch.zeros(400, dtype=torch.uint8), 0
    while checked < 1500:
        a, b = _random_view(buf, rng), _random_view(buf, rng)
        if a is None or b is None:
            continue
        assert tensors_overlap(a, b) == bool(touched(a) & touched(b)), (a.shape, a.stride(), b.shape, b.stride())
        checked += 1
    layouts._lattices_meet.cache_clear()


def test_disjointness_of_a_large_page_buffer_is_cheap():
    """2**16 pages of 1 KiB (64 MiB): the check does not enumerate bytes (it would take minutes)."""
    pages, page = 2**16, 1024
    buf = torch.zeros(pages, page, dtype=torch.uint8)
    k = buf[:, :256].view(torch.float16).view(pages, H, B, 16)
    v = buf[:, 256:512].view(torch.float16).view(pages, H, B, 16)
    start = time.perf_counter()
    CacheDesc.from_torch(k, v, block_size=B, num_kv_heads=H, head_dim=16, k_layout=Layout.HND,
                         v_layout=Layout.HND).validate()
    assert not tensors_overlap(buf[:, 1::2], buf[:, 0::2])
    assert tensors_overlap(buf[:, 511:513], buf[:, 512:600])
    assert time.perf_counter() - start < 5.0


# =============================================================================== F3: descriptors vs tensors
def test_tensor_none_is_refused_by_validate_and_ops():
    c = plain_cache()
    bad = rep(c, k=rep(c.k, tensor=None))
    refused(bad.validate, INV, "cache.k.tensor")
    for write in WRITERS:
        refused(lambda: write(bad, WriteDesc(io(1), SlotMapping(torch.tensor([0])))), INV)
    for gather in GATHERERS:
        refused(lambda: gather(bad, GatherDesc(BlockTable.packed(torch.tensor([[0]])), SeqLens(torch.tensor([1])),
                                               1)), INV)


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16, DType.F8_E4M3, DType.S32, DType.U8])
def test_descriptor_dtype_disagreeing_with_tensor_is_refused(dtype):
    """A BF16 (or any other) descriptor over a float32 tensor, on K and V alike."""
    c = plain_cache()
    bad = rep(c, k=rep(c.k, dtype=dtype), v=rep(c.v, dtype=dtype))
    refused(bad.validate, INV, "cache.k", "dtype")


@pytest.mark.parametrize("write", WRITERS, ids=["reference", "dispatch"])
def test_declared_blocks_beyond_the_tensor_are_refused(write):
    """8 declared blocks over a 2-block tensor: a write to block 7 would land outside the tensor."""
    k, v = torch.zeros(2, B, H, D), torch.zeros(2, B, H, D)
    stride = tuple(k.stride())

    def desc(t: torch.Tensor) -> TensorDesc:
        return TensorDesc(DType.F32, Layout.NHD, Memory.HOST, (8, B, H, D), stride, t, t.data_ptr())

    bad = CacheDesc(8, B, H, D, desc(k), desc(v))
    refused(bad.validate, INV, "shape")
    before = (k.clone(), v.clone())
    refused(lambda: write(bad, WriteDesc(io(1), SlotMapping(torch.tensor([7 * B])))), INV)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


@pytest.mark.parametrize("field,value", [
    ("shape", (N, B, H, D + 1)), ("shape", (N, B, H)), ("stride", (B * H * D, H * D, D, 2)),
    ("stride", (1, N, N * B, N * B * H)), ("data_ptr", 16), ("memory", Memory.DEVICE), ("memory", Memory.UNIFIED),
    ("memory", Memory.HOST_PINNED), ("shape", [N, B, H, D + 0.0]), ("shape", (N, True, H, D)),
    ("stride", "1234"), ("shape", None), ("layout", Layout.UNSPECIFIED), ("dtype", DType.UNSPECIFIED)])
def test_tensor_descriptor_field_disagreeing_with_tensor_is_refused(field, value):
    c = plain_cache()
    refused(lambda: rep(c, v=rep(c.v, **{field: value})).validate(), INV, "cache.v")
    if field != "layout":  # a layout is required of cache tensors only (IO tensors ignore it)
        refused(lambda: rep(c.v, **{field: value}).to_ctypes(), INV)


@pytest.mark.parametrize("which", ["k_scales", "k_global_scale"])
def test_quant_tensors_on_another_device_are_refused(which):
    """Scale pools and global scales live with the data pools (a meta tensor stands in for another device)."""
    q = quant_cache("nvfp4")
    good = getattr(q.quant, which)
    if which == "k_scales":
        meta = torch.empty(good.tensor.shape, dtype=good.tensor.dtype, device="meta")
        bad = TensorDesc(good.dtype, good.layout, Memory.HOST, good.shape, good.stride, meta, good.data_ptr)
    else:
        bad = torch.ones_like(good, device="meta")
    refused(lambda: rep(q, quant=rep(q.quant, **{which: bad})).validate(), INV, f"quant.{which}")


def _roundtrip(cache: CacheDesc, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    reference.write_kv(cache, WriteDesc(KvIoDesc(key, value), SlotMapping(torch.tensor([0, 1, B]))))
    out = reference.gather_kv(cache, GatherDesc(table, SeqLens(torch.tensor([B + 1])), B + 1))
    return out.key, out.value


def test_enum_fields_given_as_c_ints_are_coerced():
    """`k.dtype = 3`, `k.layout = 1`, `BlockTable(0, ...)`: ints naming a member work as the C ABI reads
    them, and give the same result as the enums."""
    want = _roundtrip(plain_cache(), BlockTable.packed(torch.tensor([[0, 1]])))
    c = plain_cache()
    c.k.dtype, c.k.layout, c.k.memory = 3, 1, 0
    c.v = TensorDesc(3, 1, 0, c.v.shape, c.v.stride, c.v.tensor, c.v.data_ptr)
    assert (type(c.k.dtype), type(c.k.layout), type(c.k.memory), type(c.v.dtype)) == (DType, Layout, Memory, DType)
    c.validate()
    got = _roundtrip(c, BlockTable(0, torch.tensor([[0, 1]]), 1, 2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q = quant_cache("int8")
    q.quant.format, q.quant.k_data_dtype, q.quant.v_data_dtype = 3, 8, 8
    assert q.quant.format is QuantFormat.INT8
    q.validate()
    s = ScaleDesc(3, 1, torch.ones(1))
    assert (s.dtype, s.granularity) == (DType.F32, ScaleGranularity.PER_TENSOR)


@pytest.mark.parametrize("value", [7, 99, -1, True, 2.0, "PACKED", None])
def test_invalid_block_table_format_is_refused(value):
    table = BlockTable(value, torch.tensor([[0, 1]]), 1, 2)
    refused(lambda: table.validate(plain_cache()), INV, "format")
    refused(table.to_ctypes, INV)
    refused(lambda: reference.gather_kv(plain_cache(), GatherDesc(table, SeqLens(torch.tensor([1])), 1)), INV)


# --------------------------------------------------------------- every field of every descriptor, wrong type
BAD_INT = [None, "3", 2.5, True, -1, 2**64, object()]  # for counts / sizes (uint32 or pointer fields)
BAD_ENUM = [None, "F32", 2.5, True, 99, -1, object()]
BAD_TENSOR = ["t", 3, [0, 1], object()]


def _valid() -> dict[str, tuple[object, callable]]:
    """A valid instance of every descriptor class and how it is validated."""
    c = plain_cache()
    q = quant_cache("nvfp4")
    table = BlockTable.packed(torch.tensor([[0, 1]]))
    lens = SeqLens(torch.tensor([B + 1]))
    pool = PoolDesc(Memory.HOST, B * H * D * 4, c.k.tensor)
    return {
        "TensorDesc": (c.k, lambda d: d.validate("t")),
        "PoolDesc": (pool, lambda d: rep(c, pool=d).validate()),
        "ScaleDesc": (ScaleDesc(DType.F32, ScaleGranularity.PER_TENSOR, torch.ones(1)), lambda d: d.validate("s")),
        "QuantDesc": (q.quant, lambda d: rep(q, quant=d).validate()),
        "CacheDesc": (c, lambda d: d.validate()),
        "BlockTable": (table, lambda d: d.validate(c)),
        "SlotMapping": (SlotMapping(torch.tensor([0, -1])), lambda d: d.validate(c)),
        "SeqLens": (lens, lambda d: d.validate(table, B)),
        "KvIoDesc": (io(2), lambda d: d.validate(c, "io")),
        "WriteDesc": (WriteDesc(io(1), SlotMapping(torch.tensor([0]))), lambda d: d.validate(c)),
        "GatherDesc": (GatherDesc(table, lens, B + 1), lambda d: d.validate(c)),
    }


FIELD_BAD = {
    "TensorDesc": {"dtype": BAD_ENUM, "layout": BAD_ENUM, "memory": BAD_ENUM, "shape": BAD_TENSOR + [None],
                   "stride": BAD_TENSOR + [None], "tensor": BAD_TENSOR + [None], "data_ptr": BAD_INT},
    "PoolDesc": {"memory": BAD_ENUM, "bytes_per_block": BAD_INT + [0], "primary": BAD_TENSOR + [None],
                 "secondary": BAD_TENSOR},
    "ScaleDesc": {"dtype": BAD_ENUM, "granularity": BAD_ENUM, "tensor": BAD_TENSOR},
    "QuantDesc": {"format": BAD_ENUM, "group_size": BAD_INT, "k_data_dtype": BAD_ENUM, "v_data_dtype": BAD_ENUM,
                  "k_scales": BAD_TENSOR, "v_scales": BAD_TENSOR, "k_global_scale": BAD_TENSOR + [None],
                  "v_global_scale": BAD_TENSOR + [None], "flags": BAD_INT, "k_smoothing": BAD_TENSOR,
                  "k_center": BAD_TENSOR},
    "CacheDesc": {"num_blocks": BAD_INT, "block_size": BAD_INT, "num_kv_heads": BAD_INT, "head_dim": BAD_INT,
                  "k": BAD_TENSOR + [None], "v": BAD_TENSOR + [None], "pool": BAD_TENSOR, "quant": BAD_TENSOR},
    "BlockTable": {"format": BAD_ENUM, "indices": BAD_TENSOR + [None], "seq_count": BAD_INT,
                   "max_blocks_per_seq": BAD_INT, "indptr": BAD_TENSOR, "beam_width": BAD_INT, "flags": BAD_INT},
    "SlotMapping": {"slots": BAD_TENSOR + [None], "invalid_slot": [None, "3", 2.5, True, 2**63, object()]},
    "SeqLens": {"lengths": BAD_TENSOR + [None]},
    "KvIoDesc": {"key": BAD_TENSOR + [None], "value": BAD_TENSOR + [None]},
    "WriteDesc": {"io": BAD_TENSOR + [None], "slots": BAD_TENSOR + [None], "k_scale": BAD_TENSOR,
                  "v_scale": BAD_TENSOR},
    "GatherDesc": {"block_table": BAD_TENSOR + [None], "seq_lens": BAD_TENSOR + [None],
                   "max_seq_len": [None, "3", 2.5, True, -1, 2**32, object()]},
}
FIELD_CASES = [(cls, f, i) for cls, fields in FIELD_BAD.items() for f, bad in fields.items() for i in range(len(bad))]


def test_field_table_covers_every_field():
    for name, (obj, _) in _valid().items():
        assert {f.name for f in dataclasses.fields(obj)} == set(FIELD_BAD[name]), name


@pytest.mark.parametrize("cls,field,i", FIELD_CASES, ids=[f"{c}.{f}[{i}]" for c, f, i in FIELD_CASES])
def test_every_descriptor_field_with_a_wrong_value_is_refused(cls, field, i):
    """validate() refuses with KvxError (not AttributeError/TypeError later in an op); so does to_ctypes."""
    obj, check = _valid()[cls]
    check(obj)  # the baseline is valid
    value = FIELD_BAD[cls][field][i]
    bad = rep(obj, **{field: value})
    refused(lambda: check(bad), INV)
    if cls in ("TensorDesc", "PoolDesc", "ScaleDesc", "CacheDesc", "BlockTable"):
        refused(bad.to_ctypes, INV)


# =============================================================================== F10: C field ranges
_RANGES = {ctypes.c_uint32: (0, 2**32 - 1), ctypes.c_int32: (-(2**31), 2**31 - 1),
           ctypes.c_int64: (-(2**63), 2**63 - 1), ctypes.c_void_p: (0, 2**64 - 1)}
SCALAR_FIELDS = [(cls, name, ctype) for cls in abi.C_NAMES for name, ctype in cls._fields_
                 if ctype in _RANGES or (issubclass(ctype, ctypes.Array) and ctype._type_ in _RANGES)]


@pytest.mark.parametrize("cls,name,ctype", SCALAR_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in SCALAR_FIELDS])
def test_new_stores_exact_values_and_refuses_the_rest(cls, name, ctype):
    """Every integer field of every struct: the bounds are stored exactly; one past them, bools, floats
    and strings are refused (ctypes would wrap 2**32 + 5 to 5 and -1 to 4294967295)."""
    array = issubclass(ctype, ctypes.Array)
    lo, hi = _RANGES[ctype._type_ if array else ctype]
    for good in (lo, hi, lo + 1):
        obj = abi.new(cls, **{name: [good] if array else good})
        got = getattr(obj, name)[0] if array else getattr(obj, name)
        assert (got or 0) == good
    for bad in (lo - 1, hi + 1, True, 2.5, "1"):
        refused(lambda: abi.new(cls, **{name: [bad] if array else bad}), INV, name)


def test_issue_reproducers_for_new():
    refused(lambda: abi.new(abi.CacheDescC, num_blocks=2**32 + 5), INV, "num_blocks")
    refused(lambda: abi.new(abi.CacheDescC, num_blocks=-1), INV, "num_blocks")
    refused(lambda: abi.new(abi.TensorDescC, shape=[2**64]), INV, "shape")
    refused(lambda: abi.new(abi.PoolDescC, bytes_per_block=2**32 + 16), INV, "bytes_per_block")
    refused(lambda: abi.new(abi.CacheDescC, k=abi.new(abi.PoolDescC)), INV, "k")
    refused(lambda: abi.new(abi.CacheDescC, shape=[1]), INV, "no field")


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [2**32 + 2, 2**32, -1, 2.0, True])
def test_cache_desc_field_beyond_its_c_field_is_refused(field, value):
    """A CacheDesc with num_blocks=2**32+2 validated and to_ctypes() reported 2."""
    bad = rep(plain_cache(), **{field: value})
    refused(bad.validate, INV, field)
    refused(bad.to_ctypes, INV, field)


def test_to_ctypes_refuses_values_its_c_fields_cannot_hold():
    c = plain_cache()
    refused(lambda: PoolDesc(Memory.HOST, 2**32 + 16, c.k.tensor).to_ctypes(), INV, "bytes_per_block")
    refused(lambda: rep(BlockTable.packed(torch.tensor([[0]])), flags=2**32).to_ctypes(), INV, "flags")
    refused(lambda: SlotMapping(torch.tensor([0]), invalid_slot=2**63).to_ctypes(), INV, "invalid_slot")
    q = quant_cache("int8")
    refused(lambda: rep(q.quant, group_size=2**32 + 32).to_ctypes(), INV, "group_size")
    refused(lambda: rep(q, quant=rep(q.quant, flags=-1)).to_ctypes(), INV, "flags")
    scale = ScaleDesc.from_torch(torch.ones(1), ScaleGranularity.PER_TENSOR)
    refused(lambda: rep(scale, granularity=2**31).to_ctypes(), INV, "granularity")
    refused(lambda: GatherDesc(BlockTable.packed(torch.tensor([[0]])), SeqLens(torch.tensor([1])),
                               2**32).validate(c), INV, "max_seq_len")


@pytest.mark.parametrize("provider", [(True, 1, 0), (1, True, 0), (1, 1, False), None, "1.1.0", (1.0, 1, 0),
                                      (1, 2**32, 0), (1, 1, 0, 0), (1, -1, 0), {1: 1}, 1])
def test_negotiate_refuses_malformed_versions(provider):
    refused(lambda: abi.negotiate(provider), INV, "version")


def test_negotiate_accepts_a_list_and_checks_major():
    abi.negotiate([1, 0, 0])
    refused(lambda: abi.negotiate([2, 0, 0]), Status.INCOMPATIBLE)


@pytest.mark.parametrize("size", [None, True, "16", 2**32, -1, 16.0])
def test_check_struct_size_refuses_non_uint32_sizes(size):
    refused(lambda: abi.check_struct_size(size, abi.VersionC), INV)


def test_quant_of_refuses_a_non_struct():
    refused(lambda: abi.quant_of(None), INV)


# =============================================================================== neighbours: layouts, block tables
GEOM = layouts.Geometry(N, B, H, D)
T1 = torch.tensor([[0]])


@pytest.mark.parametrize("call", [
    lambda: layouts.ndim_of(99),
    lambda: layouts.ndim_of("NHD"),
    lambda: layouts.canonical_shape(Layout.HND_PACKED, GEOM, 2.0),
    lambda: layouts.canonical_shape(Layout.NHD, (N, B, H, D)),
    lambda: layouts.check_shape(Layout.NHD, None, GEOM),
    lambda: layouts.check_shape(Layout.NHD, (N, B, H, D), layouts.Geometry(N, 2.5, H, D)),
    lambda: layouts.block_view(None, Layout.NHD),
    lambda: layouts.block_view(torch.zeros(N, B, H, D), 7),
    lambda: layouts.detect_layout("t", GEOM),
    lambda: layouts.from_logical([1]),
    lambda: layouts.convert(torch.zeros(N, B, H, D), Layout.NHD, 42),
    lambda: layouts.pack_of(Layout.HND_PACKED, (1,)),
    lambda: layouts.contiguous_strides(None),
    lambda: layouts.Geometry(N, True, H, D).check(),
    lambda: layouts.tensors_overlap(None, torch.zeros(1)),
    lambda: bt.blocks_needed(torch.tensor([1.0]), B),
    lambda: bt.blocks_needed(torch.tensor([1]), 0),
    lambda: bt.make_kv_cache_index(torch.tensor([0]), "yes"),
    lambda: bt.make_kv_cache_index(torch.tensor([0, 1]), torch.tensor([True] * 3)),
    lambda: bt.split_kv_cache_index(None),
    lambda: bt.packed_to_ragged(T1, torch.tensor([-1]), B),
    lambda: bt.packed_to_ragged(torch.tensor([0]), torch.tensor([1]), B),
    lambda: bt.packed_to_ragged(T1, torch.tensor([1, 2]), B),
    lambda: bt.ragged_to_packed(T1, torch.tensor([0, 1]), B),
    lambda: bt.ragged_to_packed(torch.tensor([0]), torch.tensor([0, 2, 1]), B),
    lambda: bt.ragged_to_packed(torch.tensor([0]), torch.tensor([0, 1]), B, 1.5),
    lambda: bt.packed_to_kv_offsets(T1, beam_width=0),
    lambda: bt.packed_to_kv_offsets(T1, torch.tensor([[0, 1]])),
    lambda: bt.kv_offsets_to_packed(bt.packed_to_kv_offsets(T1), beam=1),
    lambda: bt.kv_offsets_to_packed(bt.packed_to_kv_offsets(T1), kv=2),
    lambda: bt.packed_to_flashinfer(T1, torch.tensor([1.0]), B),
    lambda: bt.flashinfer_to_packed(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1, 1]), B),
    lambda: bt.flashinfer_to_packed(torch.tensor([1, 1]), torch.tensor([0]), torch.tensor([1]), B),
    lambda: bt.slot_mapping(T1, torch.tensor([0, 0]), torch.tensor([0]), B),
    lambda: bt.slot_mapping(T1, torch.tensor([0]), torch.tensor([0]), B, invalid_slot=None),
    lambda: bt.resolve_tokens(None, SeqLens(torch.tensor([1])), 1, B, N),
    lambda: bt.resolve_tokens(BlockTable.packed(T1), SeqLens(torch.tensor([1])), 1.5, B, N),
])
def test_layout_and_block_table_helpers_refuse_bad_arguments(call):
    refused(call, INV)


def test_ragged_indices_must_be_flat():
    """F8 neighbour: RAGGED indices shaped [1, n] or [n, 1] are refused by the descriptor itself."""
    ind, ip = bt.packed_to_ragged(torch.tensor([[0, 1]]), torch.tensor([B + 1]), B)
    c = plain_cache()
    BlockTable.ragged(ind, ip, 2).validate(c)
    for shaped in (ind[None], ind[:, None]):
        refused(lambda: BlockTable.ragged(shaped, ip, 2).validate(c), INV, "RAGGED", "must be 1-D")
    refused(lambda: rep(BlockTable.packed(torch.tensor([[0, 1]])), indices=torch.tensor([[0], [1]])).validate(c),
            INV, "PACKED")


def test_integer_scalars_of_numpy_and_torch_are_ints():
    """What a C or NumPy caller passes: integer scalars are stored as their value; their bools are not ints."""
    import numpy as np

    assert abi.new(abi.CacheDescC, num_blocks=np.int64(7), block_size=torch.tensor(16)).num_blocks == 7
    assert list(abi.new(abi.TensorDescC, shape=[np.int32(3), 4]).shape[:2]) == [3, 4]
    abi.negotiate((np.uint32(1), 0, 0))
    for bad in (np.True_, torch.tensor(True), torch.tensor(2.0)):
        refused(lambda: abi.new(abi.CacheDescC, num_blocks=bad), INV, "num_blocks")
    c = plain_cache()
    rep(c, num_blocks=np.int64(N)).validate()
    c.k.dtype = np.int32(3)
    assert c.k.dtype is DType.F32

