"""Spec §9 conformance tests that live in the core: layout shape/stride validation (NHD, HND,
HND_PACKED), block-table counts and indptr validation (PACKED, RAGGED, KV_OFFSETS), and invalid
slots as no-op writes. (Version and ABI size checks belong to the ABI suite.)"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvx_core import block_tables as bt
from kvx_core.descriptors import BlockTable, CacheDesc, KvIoDesc, PoolDesc, SlotMapping, WriteDesc
from kvx_core.enums import BLOCK_TABLE_FLAG_KVCACHEINDEX, BlockTableFormat, DType, Layout, Memory
from kvx_core.errors import KvxError, Status
from kvx_core.layouts import Geometry, canonical_shape, canonical_strides, check_shape, detect_layout
from kvx_core.ops.reference import write_kv

INV = Status.INVALID_ARGUMENT
GEOMS = [(1, 1, 1, 1), (3, 16, 2, 64), (5, 4, 3, 12), (2, 3, 5, 6), (7, 1, 8, 8), (2, 8, 8, 16)]


def spec_layout(layout: Layout, n: int, b: int, h: int, d: int, pack: int = 1):
    """(shape, strides) exactly as spec §4.2 writes them."""
    if layout == Layout.NHD:
        shape = (n, b, h, d)
        stride = [0] * 4
        stride[3] = 1
        stride[2] = d
        stride[1] = h * d
        stride[0] = b * h * d
    elif layout == Layout.HND:
        shape = (n, h, b, d)
        stride = [0] * 4
        stride[3] = 1
        stride[2] = d
        stride[1] = b * d
        stride[0] = h * b * d
    else:
        shape = (n, h, d // pack, b, pack)
        stride = [0] * 5
        stride[4] = 1
        stride[3] = pack
        stride[2] = b * pack
        stride[1] = (d // pack) * b * pack
        stride[0] = h * (d // pack) * b * pack
    return shape, tuple(stride)


def layout_cases():
    for n, b, h, d in GEOMS:
        yield Layout.NHD, (n, b, h, d), 1
        yield Layout.HND, (n, b, h, d), 1
        for pack in (p for p in range(1, d + 1) if d % p == 0):
            yield Layout.HND_PACKED, (n, b, h, d), pack


@pytest.mark.parametrize("layout,geom,pack", list(layout_cases()),
                         ids=lambda x: x.name if isinstance(x, Layout) else str(x))
def test_canonical_shape_and_strides_follow_spec(layout, geom, pack):
    g = Geometry(*geom)
    shape, stride = spec_layout(layout, *geom, pack)
    assert canonical_shape(layout, g, pack) == shape
    assert canonical_strides(layout, g, pack) == stride
    t = torch.zeros(shape, dtype=torch.float16)
    assert tuple(t.stride()) == stride  # what torch allocates is the canonical layout
    check_shape(layout, shape, g)
    n, b, h, d = geom
    c = CacheDesc.from_torch(t, torch.zeros_like(t), block_size=b, num_kv_heads=h, head_dim=d,
                             k_layout=layout, v_layout=layout)
    assert c.k.shape == shape and c.k.stride == stride and c.k.layout == layout and c.k.dtype == DType.F16
    assert c.k.memory == Memory.HOST and c.k.data_ptr == t.data_ptr()
    if layout != Layout.NHD and h == b and (layout != Layout.HND_PACKED):
        return  # [N, H, B, D] == [N, B, H, D]: the shape cannot name the layout (see test_layouts)
    detected = CacheDesc.from_torch(t, torch.zeros_like(t), block_size=b, num_kv_heads=h, head_dim=d)
    assert detected.k.layout == layout and detected.v.layout == layout
    assert detect_layout(t, g) == layout


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND, Layout.HND_PACKED])
def test_wrong_ndim_rejected(layout):
    g = Geometry(3, 4, 2, 8)
    shape, _ = spec_layout(layout, 3, 4, 2, 8, 2)
    for bad in (shape[:-1], shape + (1,), shape[:3]):
        with pytest.raises(KvxError) as ei:
            check_shape(layout, bad, g)
        assert ei.value.status == INV and "ndim" in ei.value.message
        t = torch.zeros(bad)
        with pytest.raises(KvxError) as ei:
            CacheDesc.from_torch(t, t.clone(), block_size=4, num_kv_heads=2, head_dim=8, k_layout=layout,
                                 v_layout=layout)
        assert ei.value.status == INV


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND, Layout.HND_PACKED])
def test_wrong_shape_rejected(layout):
    n, b, h, d = 3, 4, 2, 8
    shape, _ = spec_layout(layout, n, b, h, d, 2)
    for (i, delta) in itertools.product(range(1, 4), (-1, 1)):  # dim 0 defines num_blocks in from_torch
        bad = list(shape)
        bad[i] += delta
        t = torch.zeros(bad)
        with pytest.raises(KvxError) as ei:
            CacheDesc.from_torch(t, t.clone(), block_size=b, num_kv_heads=h, head_dim=d, k_layout=layout,
                                 v_layout=layout)
        assert ei.value.status == INV
    # K and V each checked against the cache geometry: a V one block short fails
    good = torch.zeros(shape)
    with pytest.raises(KvxError) as ei:
        CacheDesc.from_torch(good, torch.zeros((n - 1,) + shape[1:]), block_size=b, num_kv_heads=h, head_dim=d,
                             k_layout=layout, v_layout=layout)
    assert ei.value.status == INV


@pytest.mark.parametrize("head_dim,pack", [(8, 3), (6, 4), (4, 8), (12, 5), (2, 0)])
def test_hnd_packed_head_dim_not_divisible_by_pack(head_dim, pack):
    g = Geometry(2, 4, 2, head_dim)
    shape = (2, 2, max(head_dim // max(pack, 1), 1), 4, pack)
    with pytest.raises(KvxError) as ei:
        check_shape(Layout.HND_PACKED, shape, g)
    assert ei.value.status == INV and "pack" in ei.value.message
    t = torch.zeros(shape)
    with pytest.raises(KvxError) as ei:
        CacheDesc.from_torch(t, t.clone(), block_size=4, num_kv_heads=2, head_dim=head_dim,
                             k_layout=Layout.HND_PACKED, v_layout=Layout.HND_PACKED)
    assert ei.value.status == INV
    with pytest.raises(KvxError) as ei:
        canonical_shape(Layout.HND_PACKED, g, pack)
    assert ei.value.status == INV


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND, Layout.HND_PACKED])
def test_non_canonical_strides_are_honored_not_rejected(layout):
    """Spec §4.2: implementations MUST honor provided strides (a padded allocation is valid)."""
    n, b, h, d = 3, 4, 2, 8
    shape, stride = spec_layout(layout, n, b, h, d, 2)
    big = torch.zeros(tuple(x + 1 for x in shape))
    t = big[tuple(slice(0, x) for x in shape)]
    assert tuple(t.stride()) != stride
    v = torch.zeros_like(big)[tuple(slice(0, x) for x in shape)]  # its own allocation: K and V may not overlap
    c = CacheDesc.from_torch(t, v, block_size=b, num_kv_heads=h, head_dim=d, k_layout=layout, v_layout=layout)
    assert c.k.stride == tuple(big.stride())


# ----------------------------------------------------------------------------- block tables (§5.1, §7.1)
def _cache(block_size=4, pool=True):
    k = torch.zeros(8, block_size, 2, 4)
    return CacheDesc.from_torch(k, k.clone(), block_size=block_size, num_kv_heads=2, head_dim=4,
                                pool=PoolDesc(Memory.HOST, k[0].numel() * 4, k) if pool else None)


@pytest.mark.parametrize("seqs,max_blocks", [(0, 0), (0, 3), (1, 1), (3, 2), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_counts(seqs, max_blocks, dtype):
    t = BlockTable.packed(torch.zeros(seqs, max_blocks, dtype=dtype))
    assert t.indices_count == seqs * max_blocks and t.indptr_count == 0 and t.beam_width == 1
    assert t.index_dtype == (DType.S32 if dtype == torch.int32 else DType.S64)
    t.validate(_cache())
    bads = [dict(indptr=torch.zeros(seqs + 1, dtype=dtype)), dict(beam_width=2)]
    bads += [dict(seq_count=seqs + 1)] if max_blocks else []  # indices_count != seq_count * max_blocks
    bads += [dict(max_blocks_per_seq=max_blocks + 1)] if seqs else []
    for bad in bads:
        with pytest.raises(KvxError) as ei:
            dataclasses.replace(t, **bad).validate(_cache())
        assert ei.value.status == INV


@pytest.mark.parametrize("lens", [[], [0], [5], [3, 0, 7], [0, 0], [16, 1, 4]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ragged_counts_and_indptr(lens, dtype):
    table = torch.arange(len(lens) * 4, dtype=dtype).reshape(len(lens), 4) % 8
    indices, indptr = bt.packed_to_ragged(table, torch.tensor(lens, dtype=torch.int64), 4)
    t = BlockTable.ragged(indices, indptr, 4)
    assert t.seq_count == len(lens)
    assert t.indptr_count == len(lens) + 1 and t.indices_count == sum(lens)
    assert indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    t.validate(_cache())
    bad_indptrs = [indptr[:-1], torch.cat([indptr, indptr[-1:]]), indptr + 1]
    if len(lens) >= 1:
        bad_indptrs.append(torch.cat([indptr[:-1], indptr[-1:] + 1]))  # indices_count != indptr[-1]
    if any(lens[:-1]):
        decreasing = indptr.clone()
        decreasing[-1] = 0
        bad_indptrs.append(decreasing)
    for ip in bad_indptrs:
        with pytest.raises(KvxError) as ei:
            dataclasses.replace(t, indptr=ip.to(dtype)).validate(_cache())
        assert ei.value.status == INV
    for bad in (dict(seq_count=len(lens) + 1), dict(indptr=None), dict(beam_width=2)):
        with pytest.raises(KvxError) as ei:
            dataclasses.replace(t, **bad).validate(_cache())
        assert ei.value.status == INV


@pytest.mark.parametrize("seqs,beam,max_blocks", [(0, 1, 0), (1, 1, 1), (2, 3, 2), (3, 2, 4), (1, 4, 3)])
def test_kv_offsets_counts(seqs, beam, max_blocks):
    table = torch.arange(seqs * max_blocks).reshape(seqs, max_blocks) % 8
    t = BlockTable.kv_offsets(bt.packed_to_kv_offsets(table, beam_width=beam))
    assert t.indices_count == seqs * beam * 2 * max_blocks
    assert (t.seq_count, t.beam_width, t.max_blocks_per_seq) == (seqs, beam, max_blocks)
    assert t.indptr_count == 0 and t.indptr is None and t.index_dtype == DType.S32
    assert t.flags & BLOCK_TABLE_FLAG_KVCACHEINDEX and t.format == BlockTableFormat.KV_OFFSETS
    t.validate(_cache())
    bads = [dict(indptr=torch.zeros(seqs + 1, dtype=torch.int32)), dict(flags=0), dict(beam_width=0),
            dict(indices=t.indices.to(torch.int64))]
    if seqs * max_blocks:  # indices_count != seq_count * beam_width * 2 * max_blocks_per_seq
        bads += [dict(seq_count=seqs + 1), dict(max_blocks_per_seq=max_blocks + 1), dict(beam_width=beam + 1)]
    for bad in bads:
        with pytest.raises(KvxError) as ei:
            dataclasses.replace(t, **bad).validate(_cache())
        assert ei.value.status == INV
    for bs in (1, 2, 4, 8, 16):
        t.validate(_cache(bs))
    for bs in (3, 5, 6, 12):
        with pytest.raises(KvxError) as ei:
            t.validate(_cache(bs))
        assert ei.value.status == INV and "power-of-two" in ei.value.message
    with pytest.raises(KvxError) as ei:
        t.validate(_cache(pool=False))
    assert ei.value.status == INV and "pool" in ei.value.message


# ----------------------------------------------------------------------------- invalid slots (§5.2, §7)
def _raw(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the tensor's storage (a fresh copy), including bytes no view element reaches."""
    return torch.frombuffer(bytearray(t.untyped_storage()), dtype=torch.uint8)


def _make(layout, dtype, n=3, b=4, h=2, d=8):
    shape = canonical_shape(layout, Geometry(n, b, h, d), 2)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    return CacheDesc.from_torch(k, v, block_size=b, num_kv_heads=h, head_dim=d, k_layout=layout, v_layout=layout)


LAYOUTS = [Layout.NHD, Layout.HND, Layout.HND_PACKED, Layout.CUSTOM]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("slots,invalid_slot", [
    ([-1], -1), ([-1, -1, -1], -1), ([-2, -5, -1000], -1), ([-(2**31)], -1), ([-1, -7], -7),
    ([5], 5), ([5, 5, -1], 5), ([12 + 7, -3], 12 + 7), ([2**31 - 1], 2**31 - 1), ([], -1)],
    ids=lambda x: str(x))
def test_invalid_slots_are_no_ops(layout, dtype, slot_dtype, slots, invalid_slot):
    c = _make(layout, dtype)
    before = (_raw(c.k.tensor), _raw(c.v.tensor))
    s = torch.tensor(slots, dtype=slot_dtype)
    w = WriteDesc(KvIoDesc(torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)), SlotMapping(s, invalid_slot))
    write_kv(c, w)
    assert torch.equal(_raw(c.k.tensor), before[0]) and torch.equal(_raw(c.v.tensor), before[1])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("invalid_slot", [-1, 6, 100])
def test_invalid_slots_mixed_with_valid_only_touch_valid(layout, invalid_slot):
    c = _make(layout, torch.float32)
    from kvx_core.layouts import convert
    before_k = convert(c.k.tensor, layout, Layout.NHD).reshape(12, 2, 8)
    slots = torch.tensor([invalid_slot, 0, -1, 11, -9, 6 if invalid_slot != 6 else 7, invalid_slot])
    key, value = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    write_kv(c, WriteDesc(KvIoDesc(key, value), SlotMapping(slots, invalid_slot)))
    after_k = convert(c.k.tensor, layout, Layout.NHD).reshape(12, 2, 8)
    after_v = convert(c.v.tensor, layout, Layout.NHD).reshape(12, 2, 8)
    written = {int(s): i for i, s in enumerate(slots.tolist()) if s >= 0 and s != invalid_slot}
    for slot in range(12):
        if slot in written:
            assert torch.equal(after_k[slot], key[written[slot]]) and torch.equal(after_v[slot], value[written[slot]])
        else:
            assert torch.equal(after_k[slot], before_k[slot])


def test_duplicate_invalid_slots_are_not_duplicates():
    """Padding repeats -1 freely; only valid slots must be unique in a batch."""
    c = _make(Layout.NHD, torch.float32)
    w = WriteDesc(KvIoDesc(torch.randn(4, 2, 8), torch.randn(4, 2, 8)), SlotMapping(torch.tensor([-1, 3, -1, -1])))
    write_kv(c, w)
    assert torch.equal(c.k.tensor.reshape(12, 2, 8)[3], w.io.key[1])
