"""vLLM adapters: engine-written caches read through KVX and KVX-written caches read the engine's way."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvx_adapters import vllm
from kvx_core.block_tables import packed_to_ragged
from kvx_core.descriptors import BlockTable, CacheDesc, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat, DType, Layout
from kvx_core.errors import KvxError, Status
from kvx_core.ops.reference import gather_kv, write_kv

from .engine_ref import (
    DTYPES,
    make_workload,
    vllm_allocate,
    vllm_flash_read,
    vllm_kv,
    vllm_paged_read,
    vllm_reshape_and_cache,
    vllm_reshape_and_cache_flash,
)

SETTINGS = settings(max_examples=25, deadline=None)

geometry = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 37), min_size=1, max_size=4),
    "block_size": st.sampled_from([1, 2, 4, 8, 16]),
    "heads": st.integers(1, 3),
    "head_dim": st.sampled_from([8, 16, 32]),
    "dtype": st.sampled_from(DTYPES),
    "seed": st.integers(0, 2**31 - 1),
})


def _gather(cache, table: BlockTable, lens: list[int]):
    seq = SeqLens(torch.tensor(lens, dtype=torch.int32))
    return gather_kv(cache, GatherDesc(table, seq, max(lens + [0])))


def _write(cache, wl):
    write_kv(cache, WriteDesc(KvIoDesc(wl.key, wl.value), vllm.slot_mapping_from_vllm(wl.slots)))


@SETTINGS
@given(g=geometry, kind=st.sampled_from(vllm.BACKENDS), layout=st.sampled_from(["NHD", "HND"]),
       cross_layer=st.booleans())
def test_flash_engine_write_kvx_read(g, kind, layout, cross_layer):
    gen = torch.Generator().manual_seed(g["seed"])
    wl = make_workload(gen, g["lens"], g["block_size"], g["heads"], g["head_dim"], g["dtype"])
    layers = 3 if cross_layer and kind == "flash_attn" else 0
    kv = vllm_allocate(kind, layout, wl.num_blocks, wl.block_size, g["heads"], g["head_dim"], g["dtype"],
                       num_layers=layers, layer=1)
    vllm_reshape_and_cache_flash(wl.key, wl.value, *vllm_kv(kv, kind), wl.slots)

    cache = vllm.from_vllm_kv_cache(kv, backend=kind, num_kv_heads=g["heads"], head_dim=g["head_dim"],
                                    block_size=g["block_size"])
    if g["heads"] > 1 and g["block_size"] > 1:
        assert cache.k.layout == Layout[layout] and cache.v.layout == Layout[layout]
    out = _gather(cache, vllm.block_table_from_vllm(wl.table), wl.lens)
    ek, ev = wl.expected()
    assert torch.equal(out.key, ek) and torch.equal(out.value, ev)


@SETTINGS
@given(g=geometry, kind=st.sampled_from(vllm.BACKENDS), layout=st.sampled_from(["NHD", "HND"]),
       cross_layer=st.booleans())
def test_flash_kvx_write_engine_read(g, kind, layout, cross_layer):
    gen = torch.Generator().manual_seed(g["seed"])
    wl = make_workload(gen, g["lens"], g["block_size"], g["heads"], g["head_dim"], g["dtype"])
    layers = 2 if cross_layer and kind == "flash_attn" else 0
    kv = vllm_allocate(kind, layout, wl.num_blocks, wl.block_size, g["heads"], g["head_dim"], g["dtype"],
                       num_layers=layers, layer=layers - 1 if layers else 0)
    _write(vllm.from_vllm_kv_cache(kv, backend=kind), wl)

    ok = wl.slots >= 0
    k, v = vllm_flash_read(*vllm_kv(kv, kind), wl.slots[ok])
    assert torch.equal(k, wl.key[ok]) and torch.equal(v, wl.value[ok])
    untouched = torch.ones(wl.num_blocks * wl.block_size, dtype=torch.bool)
    untouched[wl.slots[ok]] = False
    rest = torch.nonzero(untouched).view(-1)
    k0, v0 = vllm_flash_read(*vllm_kv(kv, kind), rest)
    assert not k0.any() and not v0.any(), "padding (-1) tokens or stray writes touched other slots"


@pytest.mark.parametrize("kind", vllm.BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flash_zero_copy_and_reverse(kind, layout):
    kv = vllm_allocate(kind, layout, 5, 16, 2, 8, torch.bfloat16)
    cache = vllm.from_vllm_kv_cache(kv, backend=kind)
    k, v = vllm_kv(kv, kind)
    assert cache.k.tensor.data_ptr() == k.data_ptr() and cache.v.tensor.data_ptr() == v.data_ptr()
    assert cache.k.tensor.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    k[3, 7, 1, 5] = 2.5  # an engine write is visible through the descriptor
    logical = cache.k.tensor if cache.k.layout == Layout.NHD else cache.k.tensor.permute(0, 2, 1, 3)
    assert logical[3, 7, 1, 5] == 2.5

    back = vllm.to_vllm_kv_cache(cache, kind)
    assert back.shape == kv.shape and back.stride() == kv.stride() and back.data_ptr() == kv.data_ptr()
    assert back.dtype == kv.dtype


def test_flash_reverse_between_backends():
    """A flash_attn cache re-exposed in the FlashInfer backend's (N, 2, ...) shape: same memory, the
    K->V step spanning N blocks."""
    kv = vllm_allocate("flash_attn", "HND", 4, 16, 2, 8, torch.float16)
    cache = vllm.from_vllm_kv_cache(kv)
    t = vllm.to_vllm_kv_cache(cache, "flashinfer")  # (N, 2, ...) view with a K->V stride of N blocks
    assert t.shape == (4, 2, 16, 2, 8) and t.data_ptr() == kv.data_ptr()
    assert torch.equal(t[:, 0], kv[0]) and torch.equal(t[:, 1], kv[1])


def test_flash_reverse_unsupported_for_separate_kv():
    k = torch.zeros(4, 16, 2, 8)
    v = torch.zeros(4, 16, 2, 8)
    cache = CacheDesc.from_torch(k, v, block_size=16, num_kv_heads=2, head_dim=8)
    with pytest.raises(KvxError) as e:
        vllm.to_vllm_kv_cache(cache)
    assert e.value.status == Status.UNSUPPORTED and "one allocation" in e.value.message


@SETTINGS
@given(g=geometry)
def test_paged_engine_write_kvx_read_and_reverse(g):
    gen = torch.Generator().manual_seed(g["seed"])
    h, d, dt = g["heads"], g["head_dim"], g["dtype"]
    wl = make_workload(gen, g["lens"], g["block_size"], h, d, dt)
    x = 16 // torch.empty((), dtype=dt).element_size()
    # vLLM's V0 allocation (2, N, B * H * D) split by PagedAttention.split_kv_cache
    kv = torch.zeros(2, wl.num_blocks, wl.block_size * h * d, dtype=dt)
    kc, vc = vllm.split_vllm_paged_kv_cache(kv, num_kv_heads=h, head_dim=d)
    assert kc.shape == (wl.num_blocks, h, d // x, wl.block_size, x) and vc.shape == (wl.num_blocks, h, d, wl.block_size)
    vllm_reshape_and_cache(wl.key, wl.value, kc, vc, wl.slots)

    cache = vllm.from_vllm_paged(kc, vc)
    assert cache.k.layout == Layout.HND_PACKED and cache.k.shape[4] == x
    assert cache.v.layout == Layout.CUSTOM or wl.block_size == 1  # token dim innermost: no standard name
    out = _gather(cache, vllm.block_table_from_vllm(wl.table), wl.lens)
    ek, ev = wl.expected()
    assert torch.equal(out.key, ek) and torch.equal(out.value, ev)

    kv.zero_()
    _write(cache, wl)  # KVX writes, the engine's kernel arithmetic reads
    ok = wl.slots >= 0
    k, v = vllm_paged_read(kc, vc, wl.slots[ok])
    assert torch.equal(k, wl.key[ok]) and torch.equal(v, wl.value[ok])
    k2, v2 = vllm.to_vllm_paged(cache)
    assert k2.data_ptr() == kc.data_ptr() and v2.data_ptr() == vc.data_ptr()
    assert k2.shape == kc.shape and v2.shape == vc.shape and k2.is_contiguous() and v2.is_contiguous()


def test_paged_reverse_unsupported_for_nhd():
    kv = vllm_allocate("flash_attn", "NHD", 4, 16, 2, 16, torch.float16)
    with pytest.raises(KvxError) as e:
        vllm.to_vllm_paged(vllm.from_vllm_kv_cache(kv))
    assert e.value.status == Status.UNSUPPORTED


def test_fp8_byte_cache_needs_cache_dtype():
    kv = vllm_allocate("flash_attn", "HND", 4, 16, 2, 8, torch.uint8)
    with pytest.raises(KvxError) as e:
        vllm.from_vllm_kv_cache(kv)
    assert e.value.status == Status.INVALID_ARGUMENT and "cache_dtype" in e.value.message
    cache = vllm.from_vllm_kv_cache(kv, cache_dtype=torch.float8_e4m3fn)
    assert cache.k.dtype == DType.F8_E4M3 and cache.k.layout == Layout.HND
    assert cache.k.tensor.data_ptr() == kv[0].data_ptr()
    cache = vllm.from_vllm_kv_cache(kv, cache_dtype=torch.float8_e5m2)
    assert cache.v.dtype == DType.F8_E5M2


@pytest.mark.parametrize("bad, status", [
    (lambda: vllm.from_vllm_kv_cache(torch.zeros(3, 4, 16, 2, 8)), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_kv_cache(torch.zeros(2, 4, 16, 2)), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_kv_cache(torch.zeros(2, 4, 16, 2, 8), backend="xformers"), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_kv_cache(torch.zeros(2, 4, 16, 2, 8), num_kv_heads=4), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_kv_cache(torch.zeros(2, 4, 16, 2, 8, dtype=torch.int32)), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_kv_cache("not a tensor"), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_paged(torch.zeros(4, 2, 2, 16, 8), torch.zeros(4, 2, 8, 16)), Status.INVALID_ARGUMENT),
    (lambda: vllm.from_vllm_paged(torch.zeros(4, 2, 2, 16, 8, dtype=torch.half), torch.zeros(4, 2, 16, 16)),
     Status.INVALID_ARGUMENT),
    (lambda: vllm.split_vllm_paged_kv_cache(torch.zeros(2, 4, 100, dtype=torch.half), num_kv_heads=2, head_dim=8),
     Status.INVALID_ARGUMENT),
    (lambda: vllm.block_table_from_vllm(torch.zeros(4, dtype=torch.int32)), Status.INVALID_ARGUMENT),
    (lambda: vllm.block_table_from_vllm(torch.zeros(4, 2)), Status.INVALID_ARGUMENT),
    (lambda: vllm.block_table_from_vllm(torch.zeros(4, 2, dtype=torch.int32), num_reqs=5), Status.INVALID_ARGUMENT),
    (lambda: vllm.slot_mapping_from_vllm(torch.zeros(2, 2, dtype=torch.int64)), Status.INVALID_ARGUMENT),
])
def test_bad_input_is_a_kvx_error(bad, status):
    with pytest.raises(KvxError) as e:
        bad()
    assert e.value.status == status


def test_metadata_zero_copy_and_reverse():
    bt = torch.arange(24, dtype=torch.int32).view(6, 4)
    table = vllm.block_table_from_vllm(bt, num_reqs=3)
    assert table.format == BlockTableFormat.PACKED and table.seq_count == 3 and table.max_blocks_per_seq == 4
    assert table.indices.data_ptr() == bt.data_ptr()
    assert vllm.block_table_to_vllm(table).data_ptr() == bt.data_ptr()

    sm = torch.tensor([5, -1, 7, 9, -1], dtype=torch.int64)
    slots = vllm.slot_mapping_from_vllm(sm, num_tokens=4)
    assert slots.token_count == 4 and slots.invalid_slot == -1 and slots.slots.data_ptr() == sm.data_ptr()
    assert vllm.slot_mapping_to_vllm(slots).data_ptr() == sm.data_ptr()
    other = SlotMapping(torch.tensor([3, 99, -4], dtype=torch.int32), invalid_slot=99)
    assert vllm.slot_mapping_to_vllm(other).tolist() == [3, -1, -1]

    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    ragged, indptr = packed_to_ragged(bt[:3], lens, 4)
    rt = BlockTable.ragged(ragged, indptr, 4)
    back = vllm.block_table_to_vllm(rt, block_size=4)
    assert back.dtype == torch.int32
    assert torch.equal(back[0, :2], bt[0, :2]) and torch.equal(back[2, :3], bt[2, :3])
    assert vllm.seq_lens_from_vllm(lens, num_reqs=2).lengths.tolist() == [5, 0]


def test_zero_length_sequences():
    """A sequence of length 0 gathers nothing; every other sequence is intact."""
    gen = torch.Generator().manual_seed(7)
    wl = make_workload(gen, [0, 5, 0, 17], 4, 2, 8, torch.float32)
    kv = vllm_allocate("flash_attn", "NHD", wl.num_blocks, 4, 2, 8, torch.float32)
    vllm_reshape_and_cache_flash(wl.key, wl.value, kv[0], kv[1], wl.slots)
    out = _gather(vllm.from_vllm_kv_cache(kv), vllm.block_table_from_vllm(wl.table), wl.lens)
    assert out.num_tokens == 22
    assert torch.equal(out.key, wl.expected()[0])


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_packed_flash_cache_of_vllm_026(order, dtype):
    """vLLM 0.26's FlashAttention / FlashInfer cache `(blocks, heads, block_size, 2 * head_size)`, K then V in each
    token's row, in both stride orders: KVX writes where vLLM's reader looks (hand-made index oracle) and gathers
    what vLLM wrote; fp8 byte caches need `cache_dtype`."""
    n, h, b, d = 6, 3, 16, 64
    shape = (n, h, b, 2 * d) if order == "HND" else (n, b, h, 2 * d)
    raw = torch.zeros(shape, dtype=torch.uint8 if dtype != torch.bfloat16 else dtype)
    kv = raw if order == "HND" else raw.permute(0, 2, 1, 3)
    cache = vllm.from_vllm_packed_kv_cache(kv, cache_dtype=dtype if dtype != torch.bfloat16 else None,
                                           num_kv_heads=h, head_dim=d, block_size=b)
    assert cache.k.layout == (Layout.HND if order == "HND" else Layout.NHD)
    slots = torch.tensor([0, 17, 40, 95, 3])
    k, v = torch.randn(5, h, d), torch.randn(5, h, d)
    write_kv(cache, WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    view = kv.view(dtype) if dtype != torch.bfloat16 else kv
    blk, off = slots // b, slots % b
    assert torch.equal(view[blk, :, off, :d].float(), k.to(dtype).float())
    assert torch.equal(view[blk, :, off, d:].float(), v.to(dtype).float())
    with pytest.raises(KvxError):
        vllm.from_vllm_packed_kv_cache(kv, num_kv_heads=h + 1)
    with pytest.raises(KvxError):
        vllm.from_vllm_packed_kv_cache(torch.zeros(2, 2, 16, 7))
