"""Descriptors -> C structs (`to_ctypes`): every field round-trips (shape, stride, pointers, counts,
enums) and every struct's `size` is its sizeof."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvx_core import block_tables as bt
from kvx_core.abi import structs
from kvx_core.descriptors import (
    BlockTable,
    CacheDesc,
    KvIoDesc,
    PoolDesc,
    QuantDesc,
    ScaleDesc,
    SeqLens,
    SlotMapping,
    TensorDesc,
)
from kvx_core.enums import (
    BLOCK_TABLE_FLAG_KVCACHEINDEX,
    BlockTableFormat,
    DType,
    Layout,
    Memory,
    QuantFormat,
    ScaleGranularity,
)

from .helpers import build


def check_tensor(c: structs.TensorDescC, t: torch.Tensor, dtype: DType, layout: Layout, memory=Memory.HOST):
    assert c.size == ctypes.sizeof(structs.TensorDescC)
    assert (c.dtype, c.layout, c.memory, c.ndim) == (dtype, layout, memory, t.dim())
    assert list(c.shape[:t.dim()]) == list(t.shape) and list(c.stride[:t.dim()]) == list(t.stride())
    assert all(x == 0 for x in c.shape[t.dim():]) and all(x == 0 for x in c.stride[t.dim():])
    assert c.data == t.data_ptr()


@pytest.mark.parametrize("layout,pack,pad", [(Layout.NHD, 1, 0), (Layout.HND, 1, 1), (Layout.HND_PACKED, 4, 0),
                                             (Layout.HND_PACKED, 2, 1), (Layout.CUSTOM, 1, 1)])
@pytest.mark.parametrize("dtype,kdt", [(torch.float16, DType.F16), (torch.bfloat16, DType.BF16),
                                       (torch.float32, DType.F32)])
def test_cache_desc_to_ctypes(layout, pack, pad, dtype, kdt):
    x = torch.randn(3, 4, 2, 8).to(dtype)
    k = build(x, layout, pack, (3, 1, 0, 2), pad)
    v = build(x, layout, pack, (0, 2, 1, 3), 0)
    pool = PoolDesc(Memory.HOST, 4 * 2 * 8 * x.element_size(), k, build(x[:2], layout, pack))
    cache = CacheDesc.from_torch(k, v, block_size=4, num_kv_heads=2, head_dim=8, k_layout=layout, v_layout=layout,
                                 pool=pool)
    c, keep = cache.to_ctypes()
    assert keep is None and not c.quant  # a v1.0 cache: NULL quant tail
    assert c.size == ctypes.sizeof(structs.CacheDescC)
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim) == (3, 4, 2, 8)
    check_tensor(c.k, k, kdt, layout)
    check_tensor(c.v, v, kdt, layout)
    assert c.pool.size == ctypes.sizeof(structs.PoolDescC)
    assert (c.pool.memory, c.pool.bytes_per_block) == (Memory.HOST, pool.bytes_per_block)
    assert c.pool.primary == k.data_ptr() and c.pool.secondary == pool.secondary.data_ptr()
    # no pool: a zeroed, size-stamped pool struct
    c2, _ = CacheDesc.from_torch(k, v, block_size=4, num_kv_heads=2, head_dim=8, k_layout=layout,
                                 v_layout=layout).to_ctypes()
    assert c2.pool.size == ctypes.sizeof(structs.PoolDescC) and not c2.pool.primary and not c2.pool.secondary


def test_quantized_cache_desc_to_ctypes():
    k = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    scales = TensorDesc.from_torch(torch.ones(3, 4, 2, 1), Layout.CUSTOM)
    gk, gv = torch.full((2,), 0.5), torch.full((2,), 0.25)
    v_scales = TensorDesc.from_torch(torch.ones(3, 4, 2, 1), Layout.CUSTOM)  # K and V scales may not overlap
    q = QuantDesc(QuantFormat.FP8_E4M3, 8, DType.F8_E4M3, DType.F8_E4M3, scales, v_scales, gk, gv)
    cache = CacheDesc.from_torch(k, k.clone(), block_size=4, num_kv_heads=2, head_dim=8, quant=q)
    c, keep = cache.to_ctypes()
    assert isinstance(keep, structs.QuantDescC) and c.quant
    qc = c.quant.contents
    assert qc.size == ctypes.sizeof(structs.QuantDescC)
    assert (qc.format, qc.group_size, qc.k_data_dtype, qc.v_data_dtype, qc.global_scale_count) == \
        (QuantFormat.FP8_E4M3, 8, DType.F8_E4M3, DType.F8_E4M3, 2)
    check_tensor(qc.k_scales, scales.tensor, DType.F32, Layout.CUSTOM)
    assert [qc.k_global_scale[i] for i in range(2)] == [0.5, 0.5]
    assert [qc.v_global_scale[i] for i in range(2)] == [0.25, 0.25]
    check_tensor(c.k, k, DType.F8_E4M3, Layout.NHD)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_block_table_to_ctypes(dtype):
    table = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=dtype)
    p = BlockTable.packed(table).to_ctypes()
    s32 = DType.S32 if dtype == torch.int32 else DType.S64
    assert p.size == ctypes.sizeof(structs.BlockTableC)
    assert (p.format, p.index_dtype, p.indptr_dtype, p.seq_count, p.beam_width, p.max_blocks_per_seq) == \
        (BlockTableFormat.PACKED, s32, 0, 2, 1, 3)
    assert (p.indices, p.indptr, p.indices_count, p.indptr_count, p.flags) == (table.data_ptr(), None, 6, 0, 0)

    ind, ip = bt.packed_to_ragged(table, torch.tensor([5, 2]), 2)
    rt = BlockTable.ragged(ind, ip, 3)
    r = rt.to_ctypes()
    assert (r.format, r.index_dtype, r.indptr_dtype, r.seq_count, r.max_blocks_per_seq) == \
        (BlockTableFormat.RAGGED, s32, s32, 2, 3)
    assert (r.indices, r.indptr, r.indices_count, r.indptr_count) == (ind.data_ptr(), ip.data_ptr(), 7, 3)

    off = bt.packed_to_kv_offsets(table, beam_width=2)
    k = BlockTable.kv_offsets(off).to_ctypes()
    assert (k.format, k.index_dtype, k.seq_count, k.beam_width, k.max_blocks_per_seq) == \
        (BlockTableFormat.KV_OFFSETS, DType.S32, 2, 2, 3)
    assert (k.indices, k.indptr, k.indices_count, k.indptr_count, k.flags) == \
        (off.data_ptr(), None, 2 * 2 * 2 * 3, 0, BLOCK_TABLE_FLAG_KVCACHEINDEX)
    # the C struct's indices pointer reads back the table (flat, row-major)
    flat = (ctypes.c_int32 * 24).from_address(k.indices)
    assert list(flat) == off.flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_slot_mapping_and_seq_lens_to_ctypes(dtype):
    slots = torch.tensor([4, -1, 9, 2], dtype=dtype)
    c = SlotMapping(slots, invalid_slot=-(2**40)).to_ctypes()
    assert c.size == ctypes.sizeof(structs.SlotMappingC)
    assert (c.dtype, c.token_count, c.invalid_slot, c.slots) == \
        (DType.S32 if dtype == torch.int32 else DType.S64, 4, -(2**40), slots.data_ptr())
    lens = torch.tensor([3, 0, 7], dtype=dtype)
    sc = SeqLens(lens).to_ctypes()
    assert sc.size == ctypes.sizeof(structs.SeqLensC)
    assert (sc.dtype, sc.seq_count, sc.lengths) == (DType.S32 if dtype == torch.int32 else DType.S64, 3,
                                                   lens.data_ptr())


def test_io_scale_and_empty_descs_to_ctypes():
    k = torch.zeros(2, 4, 2, 8)
    cache = CacheDesc.from_torch(k, k.clone(), block_size=4, num_kv_heads=2, head_dim=8)
    key, value = torch.randn(5, 2, 8, dtype=torch.bfloat16), torch.randn(16, 5, 2)[::2].permute(1, 2, 0)
    c = KvIoDesc(key, value.to(torch.bfloat16)).to_ctypes(cache)
    assert c.size == ctypes.sizeof(structs.KvIoDescC)
    assert (c.num_tokens, c.num_kv_heads, c.head_dim) == (5, 2, 8)
    check_tensor(c.key, key, DType.BF16, Layout.CUSTOM)
    s = torch.ones(2, 1)
    sc = ScaleDesc.from_torch(s, ScaleGranularity.PER_HEAD).to_ctypes()
    assert (sc.size, sc.dtype, sc.granularity, sc.ndim, sc.data) == \
        (ctypes.sizeof(structs.ScaleDescC), DType.F32, ScaleGranularity.PER_HEAD, 2, s.data_ptr())
    assert list(sc.shape[:2]) == [2, 1] and list(sc.stride[:2]) == [1, 1]
    none = ScaleDesc.from_torch(None, ScaleGranularity.PER_TENSOR).to_ctypes()
    assert (none.granularity, none.ndim, none.data) == (ScaleGranularity.NONE, 0, None)
    empty = SlotMapping(torch.zeros(0, dtype=torch.int64)).to_ctypes()
    assert empty.token_count == 0


def test_quant_desc_without_scales_to_ctypes():
    k = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e5m2)
    q = QuantDesc(QuantFormat.FP8_E5M2, 8, DType.F8_E5M2, DType.F8_E5M2, None, None)
    c, keep = CacheDesc.from_torch(k, k.clone(), block_size=4, num_kv_heads=1, head_dim=8, quant=q).to_ctypes()
    qc = c.quant.contents
    assert qc is not None and keep is not None
    assert not qc.k_global_scale and not qc.v_global_scale and qc.global_scale_count == 0
    assert qc.k_scales.size == ctypes.sizeof(structs.TensorDescC) and qc.k_scales.data is None
