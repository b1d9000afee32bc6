"""Every validation rule of kvx_core (layouts, descriptors, block_tables, ops.reference, enums) is
triggered here and its KvxError status checked (spec §7.1, §8).

`CASES` is one table of (id, callable, expected status); each id names the rule it hits. A few
rules that need a parametrized sweep (wrong shape per dim, each zero extent) have their own tests.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvx_core import block_tables as bt
from kvx_core.descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    PoolDesc,
    QuantDesc,
    SeqLens,
    SlotMapping,
    TensorDesc,
    WriteDesc,
    storage_head_dim,
)
from kvx_core.enums import (
    BLOCK_TABLE_FLAG_KVCACHEINDEX,
    BlockTableFormat,
    DType,
    Layout,
    Memory,
    QuantFormat,
    kvx_dtype,
    torch_dtype,
)
from kvx_core.errors import KvxError, Status
from kvx_core.layouts import (
    Geometry,
    block_view,
    canonical_shape,
    check_shape,
    convert,
    detect_layout,
    from_logical,
    logical_view,
    ndim_of,
)
from kvx_core.ops.reference import gather_kv, write_kv

INV, UNS, OOR = Status.INVALID_ARGUMENT, Status.UNSUPPORTED, Status.OUT_OF_RANGE
N, B, H, D = 4, 4, 2, 8  # num_blocks, block_size, num_kv_heads, head_dim
GEOM = Geometry(N, B, H, D)
rep = dataclasses.replace


# ----------------------------------------------------------------------------- builders
def kv(dtype=torch.float32, shape=(N, B, H, D)):
    return torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)


def cache(dtype=torch.float32, block_size=B, pool=False, secondary=None, **kw) -> CacheDesc:
    k, v = kv(dtype, (N, block_size, H, D))
    p = PoolDesc(Memory.HOST, k[0].numel() * k.element_size(), k, secondary) if pool else None
    return CacheDesc.from_torch(k, v, block_size=block_size, num_kv_heads=H, head_dim=D,
                                k_layout=Layout.NHD, v_layout=Layout.NHD, pool=p, **kw)


def fp8_quant(**kw) -> QuantDesc:
    base = dict(format=QuantFormat.FP8_E4M3, group_size=D, k_data_dtype=DType.F8_E4M3, v_data_dtype=DType.F8_E4M3,
                k_scales=None, v_scales=None)
    base.update(kw)
    return QuantDesc(**base)


def quant_cache(quant: QuantDesc | None = None, validate=True, pool: PoolDesc | None = None) -> CacheDesc:
    k = torch.zeros(N, B, H, D, dtype=torch.float8_e4m3fn)
    return CacheDesc.from_torch(k, k.clone(), block_size=B, num_kv_heads=H, head_dim=D,
                                quant=quant or fp8_quant(), validate=validate, pool=pool)


def mxfp4_cache(group_size: int) -> CacheDesc:
    k = torch.zeros(N, B, H, D // 2, dtype=torch.uint8)
    q = fp8_quant(format=QuantFormat.MXFP4, group_size=group_size, k_data_dtype=DType.FP4_E2M1X2,
                  v_data_dtype=DType.FP4_E2M1X2)
    return CacheDesc.from_torch(k, k.clone(), block_size=B, num_kv_heads=H, head_dim=D, quant=q)


def io(tokens=3, h=H, d=D, dtype=torch.float32, vtokens=None, vdim=3):
    vshape = (tokens if vtokens is None else vtokens, h, d)[:vdim] + (1,) * max(0, vdim - 3)
    return KvIoDesc(torch.randn(tokens, h, d).to(dtype), torch.randn(*vshape).to(dtype))


def write(slots, tokens=None, invalid_slot=-1, **io_kw) -> WriteDesc:
    s = torch.as_tensor(slots, dtype=torch.int64) if not isinstance(slots, torch.Tensor) else slots
    return WriteDesc(io(s.numel() if tokens is None else tokens, **io_kw), SlotMapping(s, invalid_slot))


def packed(rows=((0, 1), (2, 3)), dtype=torch.int32) -> BlockTable:
    return BlockTable.packed(torch.tensor(rows, dtype=dtype))


def ragged(lens=(3, 5), dtype=torch.int32) -> BlockTable:
    ind, ip = bt.packed_to_ragged(torch.tensor([[0, 1], [2, 3]], dtype=dtype), torch.tensor(lens), B)
    return BlockTable.ragged(ind, ip, 2)


def kv_offsets(rows=((0, 1), (2, 3)), beam=1, secondary=False) -> BlockTable:
    return BlockTable.kv_offsets(bt.packed_to_kv_offsets(torch.tensor(rows), beam_width=beam, secondary=secondary))


def gather(table: BlockTable, lens=(3, 5), max_seq_len=100) -> GatherDesc:
    return GatherDesc(table, SeqLens(torch.tensor(lens)), max_seq_len)


def cache_with(**tensor_fields) -> CacheDesc:
    """A valid NHD cache whose K tensor descriptor has `tensor_fields` replaced."""
    c = cache()
    return rep(c, k=rep(c.k, **tensor_fields))


def other_device_v() -> CacheDesc:
    """K on cpu, V a (meta-device) tensor whose descriptor is otherwise valid and in HOST memory."""
    c = cache()
    meta = torch.empty(N, B, H, D, device="meta")
    return rep(c, v=rep(TensorDesc.from_torch(meta, Layout.NHD), memory=Memory.HOST, data_ptr=c.k.data_ptr))


def overlapping_cache() -> CacheDesc:
    k = torch.randn(B, H, D)[None].expand(N, B, H, D)  # stride 0 over blocks: every block aliases block 0
    return CacheDesc.from_torch(k, torch.randn(N, B, H, D), block_size=B, num_kv_heads=H, head_dim=D,
                                k_layout=Layout.CUSTOM, v_layout=Layout.NHD)


def partially_overlapping_cache() -> CacheDesc:
    base = torch.randn(N * B * H * D)
    k = base.as_strided((N, B, H, D), (B * H * D // 2, H * D, D, 1))  # blocks overlap half of the next one
    return CacheDesc.from_torch(k, torch.randn(N, B, H, D), block_size=B, num_kv_heads=H, head_dim=D,
                                k_layout=Layout.CUSTOM, v_layout=Layout.NHD)


def kv_scale_td(blocks=N) -> TensorDesc:
    return TensorDesc.from_torch(torch.ones(blocks, B, H, 1), Layout.CUSTOM)


def resolve(table, lens, n2=0, num_blocks=N, max_seq_len=100):
    return bt.resolve_tokens(table, SeqLens(torch.tensor(lens)), max_seq_len, B, num_blocks, n2)


# ----------------------------------------------------------------------------- the table
CASES = [
    # --- enums.py
    ("enums.torch_dtype(UNSPECIFIED)", lambda: torch_dtype(DType.UNSPECIFIED), INV),
    ("enums.kvx_dtype(float64) unsupported", lambda: kvx_dtype(torch.float64), UNS),
    # --- layouts.py
    ("layouts.ndim_of(UNSPECIFIED)", lambda: ndim_of(Layout.UNSPECIFIED), INV),
    ("layouts.canonical_shape pack does not divide head_dim", lambda: canonical_shape(Layout.HND_PACKED, GEOM, 3), INV),
    ("layouts.canonical_shape pack 0", lambda: canonical_shape(Layout.HND_PACKED, GEOM, 0), INV),
    ("layouts.canonical_shape UNSPECIFIED layout", lambda: canonical_shape(Layout.UNSPECIFIED, GEOM), INV),
    ("layouts.check_shape NHD given 5 dims", lambda: check_shape(Layout.NHD, (N, B, H, D, 1), GEOM), INV),
    ("layouts.check_shape HND given 3 dims", lambda: check_shape(Layout.HND, (N, H, B * D), GEOM), INV),
    ("layouts.check_shape HND_PACKED given 4 dims", lambda: check_shape(Layout.HND_PACKED, (N, H, B, D), GEOM), INV),
    ("layouts.check_shape CUSTOM given 5 dims", lambda: check_shape(Layout.CUSTOM, (N, B, H, D, 1), GEOM), INV),
    ("layouts.check_shape HND_PACKED head_dim % pack != 0",
     lambda: check_shape(Layout.HND_PACKED, (N, H, 2, B, 3), GEOM), INV),
    ("layouts.check_shape HND_PACKED pack 0", lambda: check_shape(Layout.HND_PACKED, (N, H, 0, B, 0), GEOM), INV),
    ("layouts.check_shape HND_PACKED pack > head_dim",
     lambda: check_shape(Layout.HND_PACKED, (N, H, 1, B, 2 * D), GEOM), INV),
    ("layouts.check_shape HND_PACKED D/pack dim wrong",
     lambda: check_shape(Layout.HND_PACKED, (N, H, 3, B, 2), GEOM), INV),
    ("layouts.check_shape NHD given HND order", lambda: check_shape(Layout.NHD, (N, H, B + 1, D), GEOM), INV),
    ("layouts.check_shape UNSPECIFIED", lambda: check_shape(Layout.UNSPECIFIED, (N, B, H, D), GEOM), INV),
    ("layouts.block_view UNSPECIFIED", lambda: block_view(torch.zeros(N, B, H, D), Layout.UNSPECIFIED), INV),
    ("layouts.block_view 4-D as HND_PACKED", lambda: block_view(torch.zeros(N, B, H, D), Layout.HND_PACKED), INV),
    ("layouts.block_view 5-D as NHD", lambda: block_view(torch.zeros(N, B, H, D, 1), Layout.NHD), INV),
    ("layouts.logical_view HND_PACKED (pack 2, block_size 4) unsupported",
     lambda: logical_view(torch.zeros(N, H, D // 2, B, 2), Layout.HND_PACKED), UNS),
    ("layouts.detect_layout unrelated shape", lambda: detect_layout(torch.zeros(N, B, H, D + 1), GEOM), INV),
    ("layouts.detect_layout 3-D", lambda: detect_layout(torch.zeros(N, B, H * D), GEOM), INV),
    ("layouts.detect_layout 5-D with wrong head_dim", lambda: detect_layout(torch.zeros(N, H, 3, B, 2), GEOM), INV),
    ("layouts.from_logical 5-D", lambda: from_logical(torch.zeros(N, B, H, D, 1)), INV),
    ("layouts.convert to HND_PACKED with bad pack",
     lambda: convert(torch.zeros(N, B, H, D), Layout.NHD, Layout.HND_PACKED, 3), INV),
    ("layouts.convert from a wrong-rank source", lambda: convert(torch.zeros(N, B, H), Layout.NHD, Layout.HND), INV),
    # --- descriptors.py: TensorDesc
    ("TensorDesc.from_torch declared dtype != storage",
     lambda: TensorDesc.from_torch(torch.zeros(2), dtype=DType.F16), INV),
    ("TensorDesc.from_torch float64 unsupported",
     lambda: TensorDesc.from_torch(torch.zeros(2, dtype=torch.float64)), UNS),
    ("TensorDesc.from_torch UNSPECIFIED dtype",
     lambda: TensorDesc.from_torch(torch.zeros(2), dtype=DType.UNSPECIFIED), INV),
    ("cache.k dtype UNSPECIFIED", lambda: cache_with(dtype=DType.UNSPECIFIED).validate(), INV),
    ("cache.k ndim 0", lambda: cache_with(shape=(), stride=()).validate(), INV),
    ("cache.k ndim 6",
     lambda: cache_with(shape=(N, B, H, D, 1, 1), stride=(B * H * D, H * D, D, 1, 1, 1)).validate(), INV),
    ("cache.k stride count != ndim", lambda: cache_with(stride=(B * H * D, H * D, D)).validate(), INV),
    ("cache.k NULL data pointer", lambda: cache_with(data_ptr=0).validate(), INV),
    ("cache.k negative stride", lambda: cache_with(stride=(B * H * D, H * D, -D, 1)).validate(), INV),
    ("cache.k negative stride on a size-1 dim",
     lambda: cache_with(shape=(1, B, H, D), stride=(-1, H * D, D, 1)).validate(), INV),
    ("cache.k zero stride (expanded tensor) overlaps", lambda: overlapping_cache().validate(), INV),
    ("cache.k partially overlapping blocks", lambda: partially_overlapping_cache().validate(), INV),
    ("cache.k heads overlap head_dim", lambda: cache_with(stride=(B * H * D, H * D, D // 2, 1)).validate(), INV),
    # --- descriptors.py: CacheDesc
    ("CacheDesc.from_torch block_size 0",
     lambda: CacheDesc.from_torch(*kv(), block_size=0, num_kv_heads=H, head_dim=D), INV),
    ("CacheDesc.from_torch num_blocks 0 (empty tensors)",
     lambda: CacheDesc.from_torch(*kv(shape=(0, B, H, D)), block_size=B, num_kv_heads=H, head_dim=D,
                                  k_layout=Layout.NHD, v_layout=Layout.NHD), INV),
    ("CacheDesc.from_torch undetectable layout",
     lambda: CacheDesc.from_torch(*kv(), block_size=B, num_kv_heads=H, head_dim=D + 2), INV),
    ("cache.k layout UNSPECIFIED", lambda: cache_with(layout=Layout.UNSPECIFIED).validate(), INV),
    ("cache.k S32 is not a cache dtype",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, D, dtype=torch.int32),
                                  torch.zeros(N, B, H, D, dtype=torch.int32),
                                  block_size=B, num_kv_heads=H, head_dim=D), INV),
    ("cache.k S64 is not a cache dtype", lambda: cache_with(dtype=DType.S64).validate(), INV),
    ("cache.k U8 without quant descriptor",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, D, dtype=torch.uint8),
                                  torch.zeros(N, B, H, D, dtype=torch.uint8),
                                  block_size=B, num_kv_heads=H, head_dim=D), INV),
    ("cache.k FP4_E2M1X2 without quant descriptor", lambda: cache_with(dtype=DType.FP4_E2M1X2).validate(), INV),
    ("cache K/V shape disagree (V has one more block)",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, D), torch.zeros(N + 1, B, H, D), block_size=B,
                                  num_kv_heads=H, head_dim=D), INV),
    ("cache K layout NHD but tensor is HND-shaped",
     lambda: CacheDesc.from_torch(torch.zeros(N, H, B + 1, D), torch.zeros(N, H, B + 1, D), block_size=B + 1,
                                  num_kv_heads=H, head_dim=D, k_layout=Layout.NHD, v_layout=Layout.NHD), INV),
    ("cache K/V in different memories (host vs pinned)",
     lambda: (lambda c: rep(c, v=rep(c.v, memory=Memory.HOST_PINNED)).validate())(cache()), INV),
    ("cache K/V in different memories (host vs device)",
     lambda: (lambda c: rep(c, k=rep(c.k, memory=Memory.DEVICE)).validate())(cache()), INV),
    ("cache K/V on different torch devices", lambda: other_device_v().validate(), INV),
    ("cache K/V dtype mismatch (F32 vs F16)",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, D), torch.zeros(N, B, H, D, dtype=torch.float16),
                                  block_size=B, num_kv_heads=H, head_dim=D), INV),
    ("cache K/V dtype mismatch (F16 vs BF16)",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, D, dtype=torch.float16),
                                  torch.zeros(N, B, H, D, dtype=torch.bfloat16), block_size=B, num_kv_heads=H,
                                  head_dim=D), INV),
    ("pool.bytes_per_block 0", lambda: rep(cache(), pool=PoolDesc(Memory.HOST, 0, torch.zeros(1))).validate(), INV),
    ("pool.primary NULL", lambda: rep(cache(), pool=PoolDesc(Memory.HOST, 64, None)).validate(), INV),
    # --- descriptors.py: quantization descriptor
    ("storage_head_dim odd head_dim for FP4_E2M1X2", lambda: storage_head_dim(7, DType.FP4_E2M1X2), INV),
    ("storage_head_dim odd head_dim for INT4X2", lambda: storage_head_dim(5, DType.INT4X2), INV),
    ("quant.format NONE", lambda: quant_cache(fp8_quant(format=QuantFormat.NONE)), INV),
    ("quant.group_size 0", lambda: quant_cache(fp8_quant(group_size=0)), INV),
    ("quant.group_size does not divide head_dim", lambda: quant_cache(fp8_quant(group_size=3)), INV),
    ("quant data dtypes differ from the cache tensors",
     lambda: rep(quant_cache(), quant=fp8_quant(v_data_dtype=DType.F8_E5M2)).validate(), INV),
    ("quant.k_scales tensor invalid (negative stride)",
     lambda: quant_cache(fp8_quant(k_scales=rep(kv_scale_td(), stride=(-1, 1, 1, 1)))), INV),
    ("quant.v_scales pool has a different block count",
     lambda: quant_cache(fp8_quant(v_scales=kv_scale_td(N + 1))), INV),
    ("quant global scale count neither 1 nor num_kv_heads",
     lambda: quant_cache(fp8_quant(k_global_scale=torch.ones(H + 1), v_global_scale=torch.ones(H + 1))), INV),
    ("quant global scale not FP32",
     lambda: quant_cache(fp8_quant(k_global_scale=torch.ones(1),
                                   v_global_scale=torch.ones(1, dtype=torch.float16))), INV),
    ("quant v_global_scale missing while k_global_scale set",
     lambda: quant_cache(fp8_quant(k_global_scale=torch.ones(1))), INV),
    ("quant v_global_scale count != k_global_scale count",
     lambda: quant_cache(fp8_quant(k_global_scale=torch.ones(1), v_global_scale=torch.ones(H))), INV),
    ("quant FP4 cache with odd head_dim",
     lambda: CacheDesc.from_torch(torch.zeros(N, B, H, 3, dtype=torch.uint8),
                                  torch.zeros(N, B, H, 3, dtype=torch.uint8),
                                  block_size=B, num_kv_heads=H, head_dim=7,
                                  quant=fp8_quant(format=QuantFormat.NVFP4, group_size=7,
                                                  k_data_dtype=DType.FP4_E2M1X2, v_data_dtype=DType.FP4_E2M1X2)), INV),
    # --- descriptors.py: BlockTable constructors
    ("BlockTable.packed 1-D", lambda: BlockTable.packed(torch.zeros(4, dtype=torch.int32)), INV),
    ("BlockTable.packed 3-D", lambda: BlockTable.packed(torch.zeros(1, 2, 2, dtype=torch.int32)), INV),
    ("BlockTable.ragged 2-D indptr", lambda: BlockTable.ragged(torch.zeros(0), torch.zeros(1, 2), 1), INV),
    ("BlockTable.ragged empty indptr", lambda: BlockTable.ragged(torch.zeros(0), torch.zeros(0), 1), INV),
    ("BlockTable.kv_offsets 3-D", lambda: BlockTable.kv_offsets(torch.zeros(1, 2, 2, dtype=torch.int32)), INV),
    ("BlockTable.kv_offsets dim 2 is not K/V",
     lambda: BlockTable.kv_offsets(torch.zeros(1, 1, 3, 2, dtype=torch.int32)), INV),
    # --- descriptors.py: BlockTable.validate, KV_OFFSETS
    ("KV_OFFSETS with S64 indices",
     lambda: BlockTable.kv_offsets(kv_offsets().indices.to(torch.int64)).validate(cache(pool=True)), INV),
    ("KV_OFFSETS with float64 indices (no KVX index dtype)",
     lambda: BlockTable.kv_offsets(kv_offsets().indices.to(torch.float64)).validate(), INV),
    ("KV_OFFSETS missing KVCACHEINDEX flag", lambda: rep(kv_offsets(), flags=0).validate(cache(pool=True)), INV),
    ("KV_OFFSETS other flags but not KVCACHEINDEX", lambda: rep(kv_offsets(), flags=1 << 3).validate(), INV),
    ("KV_OFFSETS non-power-of-two block_size 3", lambda: kv_offsets().validate(cache(block_size=3, pool=True)), INV),
    ("KV_OFFSETS non-power-of-two block_size 6", lambda: kv_offsets().validate(cache(block_size=6, pool=True)), INV),
    ("KV_OFFSETS without cache.pool", lambda: kv_offsets().validate(cache()), INV),
    ("KV_OFFSETS indices_count mismatch (max_blocks_per_seq)",
     lambda: rep(kv_offsets(), max_blocks_per_seq=3).validate(), INV),
    ("KV_OFFSETS indices_count mismatch (beam_width)", lambda: rep(kv_offsets(), beam_width=2).validate(), INV),
    ("KV_OFFSETS indices_count mismatch (seq_count)", lambda: rep(kv_offsets(), seq_count=1).validate(), INV),
    ("KV_OFFSETS beam_width 0",
     lambda: BlockTable.kv_offsets(torch.zeros(2, 0, 2, 2, dtype=torch.int32)).validate(), INV),
    ("KV_OFFSETS with an indptr",
     lambda: rep(kv_offsets(), indptr=torch.tensor([0, 2, 4], dtype=torch.int32)).validate(), INV),
    # --- BlockTable.validate, PACKED
    ("PACKED float32 indices", lambda: packed(dtype=torch.float32).validate(), INV),
    ("PACKED uint8 indices", lambda: packed(dtype=torch.uint8).validate(), INV),
    ("PACKED float64 indices (no KVX index dtype)", lambda: packed(dtype=torch.float64).validate(), INV),
    ("PACKED beam_width 2", lambda: rep(packed(), beam_width=2).validate(), INV),
    ("PACKED beam_width 0", lambda: rep(packed(), beam_width=0).validate(), INV),
    ("PACKED with an indptr", lambda: rep(packed(), indptr=torch.tensor([0, 2, 4])).validate(), INV),
    ("PACKED indices_count mismatch (seq_count)", lambda: rep(packed(), seq_count=3).validate(), INV),
    ("PACKED indices_count mismatch (max_blocks_per_seq)", lambda: rep(packed(), max_blocks_per_seq=1).validate(), INV),
    # --- BlockTable.validate, RAGGED
    ("RAGGED float32 indices", lambda: rep(ragged(), indices=ragged().indices.float()).validate(), INV),
    ("RAGGED beam_width 2", lambda: rep(ragged(), beam_width=2).validate(), INV),
    ("RAGGED indptr NULL", lambda: rep(ragged(), indptr=None).validate(), INV),
    ("RAGGED indptr_count != seq_count + 1 (seq_count)", lambda: rep(ragged(), seq_count=3).validate(), INV),
    ("RAGGED indptr_count != seq_count + 1 (indptr)",
     lambda: rep(ragged(), indptr=torch.tensor([0, 3, 8, 8], dtype=torch.int32)).validate(), INV),
    ("RAGGED float32 indptr", lambda: rep(ragged(), indptr=torch.tensor([0.0, 3.0, 8.0])).validate(), INV),
    ("RAGGED float64 indptr (no KVX index dtype)",
     lambda: rep(ragged(), indptr=torch.tensor([0.0, 3.0, 8.0], dtype=torch.float64)).validate(), INV),
    ("RAGGED 2-D indptr", lambda: rep(ragged(), indptr=torch.tensor([[0, 3, 8]])).validate(), INV),
    ("RAGGED indptr[0] != 0", lambda: rep(ragged(), indptr=torch.tensor([1, 3, 8])).validate(), INV),
    ("RAGGED non-monotone indptr", lambda: rep(ragged(), indptr=torch.tensor([0, 5, 3])).validate(), INV),
    ("RAGGED indices_count != indptr[-1]", lambda: rep(ragged(), indptr=torch.tensor([0, 3, 7])).validate(), INV),
    ("RAGGED indices_count != indptr[-1] (extra index)",
     lambda: rep(ragged(), indices=torch.zeros(9, dtype=torch.int32)).validate(), INV),
    # --- SlotMapping
    ("slots float32", lambda: SlotMapping(torch.zeros(3)).validate(cache()), INV),
    ("slots float64 (no KVX index dtype)",
     lambda: SlotMapping(torch.zeros(3, dtype=torch.float64)).validate(cache()), INV),
    ("slots uint8", lambda: SlotMapping(torch.zeros(3, dtype=torch.uint8)).validate(cache()), INV),
    ("slots 2-D", lambda: SlotMapping(torch.zeros(1, 3, dtype=torch.int64)).validate(cache()), INV),
    ("slot == num_blocks * block_size out of range",
     lambda: SlotMapping(torch.tensor([0, N * B])).validate(cache()), OOR),
    ("slot far out of range (S32)",
     lambda: SlotMapping(torch.tensor([2**31 - 1], dtype=torch.int32)).validate(cache()), OOR),
    ("slot out of range next to a custom invalid_slot",
     lambda: SlotMapping(torch.tensor([7, N * B + 3]), invalid_slot=7).validate(cache()), OOR),
    # --- SeqLens
    ("seq_lens float32", lambda: SeqLens(torch.tensor([1.0, 2.0])).validate(packed(), B), INV),
    ("seq_lens float64 (no KVX index dtype)",
     lambda: SeqLens(torch.tensor([1.0, 2.0], dtype=torch.float64)).validate(packed(), B), INV),
    ("seq_lens 2-D", lambda: SeqLens(torch.tensor([[1, 2]])).validate(packed(), B), INV),
    ("seq_lens count != block table seq_count", lambda: SeqLens(torch.tensor([1, 2, 3])).validate(packed(), B), INV),
    ("seq_lens count != RAGGED seq_count", lambda: SeqLens(torch.tensor([3])).validate(ragged(), B), INV),
    ("seq_lens count != KV_OFFSETS seq_count", lambda: SeqLens(torch.tensor([3])).validate(kv_offsets(), B), INV),
    ("seq_lens negative", lambda: SeqLens(torch.tensor([1, -1])).validate(packed(), B), INV),
    ("seq_lens beyond PACKED capacity", lambda: SeqLens(torch.tensor([1, 2 * B + 1])).validate(packed(), B), OOR),
    ("seq_lens beyond KV_OFFSETS capacity",
     lambda: SeqLens(torch.tensor([2 * B + 1, 0])).validate(kv_offsets(), B), OOR),
    # --- KvIoDesc / WriteDesc / GatherDesc
    ("io.key 2-D", lambda: KvIoDesc(torch.zeros(3, H * D), torch.zeros(3, H, D)).validate(cache(), "io"), INV),
    ("io.value 4-D", lambda: io(vdim=4).validate(cache(), "io"), INV),
    ("io dtype int32 unsupported", lambda: io(dtype=torch.int32).validate(cache(), "io"), UNS),
    ("io dtype float64 unsupported", lambda: io(dtype=torch.float64).validate(cache(), "io"), UNS),
    ("io dtype float8 unsupported", lambda: io(dtype=torch.float8_e4m3fn).validate(cache(), "io"), UNS),
    ("io value dtype unsupported",
     lambda: KvIoDesc(torch.zeros(3, H, D), torch.zeros(3, H, D, dtype=torch.int64)).validate(cache(), "io"), UNS),
    ("io value num_tokens != key num_tokens", lambda: io(3, vtokens=4).validate(cache(), "io"), INV),
    ("io num_kv_heads != cache", lambda: io(h=H + 1).validate(cache(), "io"), INV),
    ("io head_dim != cache", lambda: io(d=D // 2).validate(cache(), "io"), INV),
    ("io on another device than the cache",
     lambda: KvIoDesc(torch.empty(3, H, D, device="meta"),
                      torch.empty(3, H, D, device="meta")).validate(cache(), "io"), INV),
    ("write slot count != num_tokens", lambda: write([0, 1, 2], tokens=2).validate(cache()), INV),
    ("write num_tokens mismatch through write_kv", lambda: write_kv(cache(), write([0, 1, 2], tokens=4)), INV),
    ("write num_kv_heads mismatch through write_kv", lambda: write_kv(cache(), write([0, 1], h=1)), INV),
    ("write head_dim mismatch through write_kv", lambda: write_kv(cache(), write([0, 1], d=D + 1)), INV),
    ("write unsupported io dtype through write_kv", lambda: write_kv(cache(), write([0, 1], dtype=torch.float64)), UNS),
    ("write slot out of range through write_kv", lambda: write_kv(cache(), write([0, N * B])), OOR),
    ("gather max_seq_len negative", lambda: gather(packed(), max_seq_len=-1).validate(cache()), INV),
    # --- block_tables.py
    ("make_kv_cache_index -2", lambda: bt.make_kv_cache_index(torch.tensor([0, -2])), OOR),
    ("make_kv_cache_index 2**31", lambda: bt.make_kv_cache_index(torch.tensor([2**31])), OOR),
    ("make_kv_cache_index secondary 2**31-1 would encode as null",
     lambda: bt.make_kv_cache_index(torch.tensor([2**31 - 1]), True), OOR),
    ("packed_to_ragged length needs more blocks than the table has",
     lambda: bt.packed_to_ragged(torch.tensor([[0, 1]]), torch.tensor([2 * B + 1]), B), OOR),
    ("ragged_to_packed max_blocks_per_seq too small",
     lambda: bt.ragged_to_packed(torch.zeros(B + 1, dtype=torch.int32), torch.tensor([0, B + 1]), B, 1), OOR),
    ("ragged_to_packed tokens of one block name two block ids",
     lambda: bt.ragged_to_packed(torch.tensor([0, 1]), torch.tensor([0, 2]), B), INV),
    ("ragged_to_packed indptr[-1] != number of indices",
     lambda: bt.ragged_to_packed(torch.tensor([0, 0, 0]), torch.tensor([0, 2]), B), INV),
    ("ragged_to_packed empty indptr", lambda: bt.ragged_to_packed(torch.tensor([]), torch.tensor([]), B), INV),
    ("flashinfer_to_packed indptr[-1] != number of pages",
     lambda: bt.flashinfer_to_packed(torch.tensor([0, 2]), torch.tensor([3]), torch.tensor([1]), B), INV),
    ("packed_to_flashinfer length needs more blocks than the table has",
     lambda: bt.packed_to_flashinfer(torch.tensor([[0]]), torch.tensor([B + 1]), B), OOR),
    ("flashinfer_to_packed last_page_len 0 for a non-empty sequence",
     lambda: bt.flashinfer_to_packed(torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([0]), B), INV),
    ("flashinfer_to_packed last_page_len > block_size",
     lambda: bt.flashinfer_to_packed(torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([B + 1]), B), INV),
    ("flashinfer_to_packed last_page_len != 0 for an empty sequence",
     lambda: bt.flashinfer_to_packed(torch.tensor([0, 0]), torch.tensor([], dtype=torch.int64), torch.tensor([1]),
                                     B), INV),
    ("slot_mapping position beyond the table",
     lambda: bt.slot_mapping(torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([2 * B]), B), OOR),
    ("slot_mapping sequence id beyond the table",
     lambda: bt.slot_mapping(torch.tensor([[0, 1]]), torch.tensor([1]), torch.tensor([0]), B), OOR),
    ("resolve RAGGED length beyond its indptr span", lambda: resolve(ragged(), [4, 5]), OOR),
    ("resolve RAGGED length beyond its span even when truncated",
     lambda: resolve(ragged(), [4, 5], max_seq_len=1), OOR),
    ("resolve RAGGED block id out of range",
     lambda: resolve(rep(ragged(), indices=torch.full((8,), N, dtype=torch.int32)), [3, 5]), OOR),
    ("resolve PACKED block id == num_blocks", lambda: resolve(packed(((0, N),)), [B + 1]), OOR),
    ("resolve PACKED block id -1 inside the length", lambda: resolve(packed(((0, -1),)), [B + 1]), OOR),
    ("resolve KV_OFFSETS null index inside the length", lambda: resolve(kv_offsets(((0, -1),)), [B + 1]), OOR),
    ("resolve KV_OFFSETS V null index inside the length",
     lambda: resolve(BlockTable.kv_offsets(bt.packed_to_kv_offsets(torch.tensor([[0, 1]]), torch.tensor([[0, -1]]))),
                     [B + 1]), OOR),
    ("resolve KV_OFFSETS primary block out of range", lambda: resolve(kv_offsets(((0, N + 3),)), [B + 1]), OOR),
    ("resolve KV_OFFSETS secondary block beyond the secondary pool",
     lambda: resolve(kv_offsets(((0, 1),), secondary=True), [B + 1], n2=1), OOR),
    ("resolve KV_OFFSETS secondary referenced without a secondary pool",
     lambda: resolve(kv_offsets(((0, 1),), secondary=True), [B + 1], n2=None), INV),
    # --- ops/reference.py
    # the reference ops encode/decode every registered cache format; what they cannot do is UNSUPPORTED
    ("write_kv into a cache of an unsupported quantized format (MXFP4 group 8)",
     lambda: write_kv(mxfp4_cache(8), write([0])), UNS),
    ("gather_kv from a cache of an unsupported quantized format (MXFP4 group 8)",
     lambda: gather_kv(mxfp4_cache(8), gather(packed())), UNS),
    ("gather_kv quantized cache reading the secondary pool", lambda: gather_kv(
        quant_cache(pool=PoolDesc(Memory.HOST, 64, torch.zeros(1), torch.zeros(N, B, H, D, dtype=torch.float8_e4m3fn))),
        gather(kv_offsets(secondary=True))), UNS),
    ("write_kv into an invalid cache", lambda: write_kv(cache_with(data_ptr=0), write([0])), INV),
    ("write_kv duplicate slots", lambda: write_kv(cache(), write([3, 5, 3])), INV),
    ("write_kv K and V are one buffer",
     lambda: (lambda k: write_kv(CacheDesc.from_torch(k, k, block_size=B, num_kv_heads=H, head_dim=D),
                                 write([1])))(torch.zeros(N, B, H, D)), INV),
    ("write_kv duplicate slots in S32", lambda: write_kv(cache(), write(torch.tensor([1, 1], dtype=torch.int32))), INV),
    ("gather_kv from an invalid cache",
     lambda: gather_kv(cache_with(layout=Layout.UNSPECIFIED), gather(packed())), INV),
    ("gather_kv invalid block table", lambda: gather_kv(cache(), gather(rep(packed(), beam_width=2))), INV),
    ("gather_kv seq_lens count mismatch", lambda: gather_kv(cache(), gather(packed(), lens=(1,))), INV),
    ("gather_kv block id out of range", lambda: gather_kv(cache(), gather(packed(((0, 1), (2, N))))), OOR),
    ("gather_kv RAGGED block id out of range",
     lambda: gather_kv(cache(), gather(rep(ragged(), indices=torch.full((8,), -1, dtype=torch.int32)))), OOR),
    ("gather_kv KV_OFFSETS null index inside length",
     lambda: gather_kv(cache(pool=True), gather(kv_offsets(((0, 1), (2, -1))))), OOR),
    ("gather_kv secondary referenced without a secondary pool",
     lambda: gather_kv(cache(pool=True),
                       gather(kv_offsets(secondary=torch.tensor([[False, False], [True, False]])))), INV),
    ("gather_kv secondary pool with the wrong dtype",
     lambda: gather_kv(cache(pool=True, secondary=torch.zeros(4, B, H, D, dtype=torch.float16)),
                       gather(kv_offsets(secondary=True))), INV),
    ("gather_kv secondary pool with the wrong block shape",
     lambda: gather_kv(cache(pool=True, secondary=torch.zeros(4, B, H, D + 1)),
                       gather(kv_offsets(secondary=True))), INV),
    ("gather_kv secondary block id beyond the secondary pool",
     lambda: gather_kv(cache(pool=True, secondary=torch.zeros(3, B, H, D)), gather(kv_offsets(secondary=True))), OOR),
    ("gather_kv output too small",
     lambda: gather_kv(cache(), gather(packed()), KvIoDesc(torch.zeros(7, H, D), torch.zeros(7, H, D))), INV),
    ("gather_kv output unsupported dtype",
     lambda: gather_kv(cache(), gather(packed()), KvIoDesc(torch.zeros(8, H, D, dtype=torch.int32),
                                                           torch.zeros(8, H, D, dtype=torch.int32))), UNS),
    ("gather_kv output with the wrong head_dim",
     lambda: gather_kv(cache(), gather(packed()), KvIoDesc(torch.zeros(8, H, D + 1), torch.zeros(8, H, D + 1))), INV),
]


@pytest.mark.parametrize("fn,status", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(fn, status):
    with pytest.raises(KvxError) as ei:
        fn()
    assert ei.value.status == status, ei.value
    assert ei.value.message and str(ei.value).startswith(f"[KVX_STATUS_{status.name}]")


def test_case_ids_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


# ----------------------------------------------------------------------------- sweeps
@pytest.mark.parametrize("field", ["num_blocks", "block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1])
def test_zero_or_negative_geometry(field, value):
    with pytest.raises(KvxError) as ei:
        Geometry(**{**dataclasses.asdict(GEOM), field: value}).check()
    assert ei.value.status == INV and field in ei.value.message
    with pytest.raises(KvxError) as ei:
        rep(cache(), **{field: value}).validate()
    assert ei.value.status == INV and field in ei.value.message


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_dim"])
def test_zero_geometry_from_torch(field):
    kw = dict(block_size=B, num_kv_heads=H, head_dim=D)
    kw[field] = 0
    with pytest.raises(KvxError) as ei:
        CacheDesc.from_torch(*kv(), k_layout=Layout.NHD, v_layout=Layout.NHD, **kw)
    assert ei.value.status == INV


def test_valid_baselines_pass():
    """The builders the table perturbs are valid as they stand (so each case fails for its own reason)."""
    c, cp = cache(), cache(pool=True, secondary=torch.zeros(N, B, H, D))
    c.validate()
    cp.validate()
    quant_cache().validate()
    quant_cache(fp8_quant(k_scales=kv_scale_td(), v_scales=kv_scale_td(), k_global_scale=torch.ones(H),
                          v_global_scale=torch.ones(H))).validate()
    for table in (packed(), ragged(), kv_offsets(), kv_offsets(beam=3)):
        table.validate()
        table.validate(cp)
    for dt in (torch.int32, torch.int64):
        packed(dtype=dt).validate(c)
        ragged(dtype=dt).validate(c)
        SlotMapping(torch.tensor([0, N * B - 1, -1], dtype=dt)).validate(c)
        SeqLens(torch.tensor([0, 2 * B], dtype=dt)).validate(packed(), B)
    write([0, 1]).validate(c)
    gather(packed()).validate(c)
    gather(ragged()).validate(c)
    gather(kv_offsets()).validate(cp)
    io().validate(c, "io")
    resolve(kv_offsets(((0, 1),), secondary=True), [B + 1], n2=2)
    bt.make_kv_cache_index(torch.tensor([2**31 - 1, -1]), False)
    bt.make_kv_cache_index(torch.tensor([2**31 - 2, -1]), True)
    storage_head_dim(8, DType.FP4_E2M1X2)


@pytest.mark.parametrize("layout,good", [
    (Layout.NHD, (N, B, H, D)), (Layout.HND, (N, H, B, D)), (Layout.CUSTOM, (N, B, H, D)),
    (Layout.HND_PACKED, (N, H, D // 2, B, 2))])
def test_wrong_shape_each_dim(layout, good):
    """Spec §4.2: `shape` MUST agree with the cache descriptor, dim by dim."""
    check_shape(layout, good, GEOM)
    for i in range(len(good)):
        if layout == Layout.HND_PACKED and i == 4:
            continue  # the pack dim defines the pack; tested separately (head_dim % pack)
        for delta in (-1, 1):
            bad = list(good)
            bad[i] += delta
            with pytest.raises(KvxError) as ei:
                check_shape(layout, tuple(bad), GEOM)
            assert ei.value.status == INV
            if bad[i] > 0:
                # through a descriptor: a valid cache whose V tensor has the wrong shape
                valid = CacheDesc.from_torch(torch.zeros(good), torch.zeros(good), block_size=B, num_kv_heads=H,
                                             head_dim=D, k_layout=layout, v_layout=layout)
                with pytest.raises(KvxError) as ei:
                    rep(valid, v=TensorDesc.from_torch(torch.zeros(bad), layout)).validate()
                assert ei.value.status == INV and "cache.v" in ei.value.message


def test_v_descriptor_validated_like_k():
    c = cache()
    for field, value in (("dtype", DType.UNSPECIFIED), ("layout", Layout.UNSPECIFIED), ("data_ptr", 0),
                         ("stride", (0, 0, 0, 0)), ("shape", (N, B, H, D + 1))):
        with pytest.raises(KvxError) as ei:
            rep(c, v=rep(c.v, **{field: value})).validate()
        assert ei.value.status == INV and "cache.v" in ei.value.message


def test_kv_offsets_extra_flag_bits_allowed():
    """KV_OFFSETS with the KVCACHEINDEX flag plus other bits is still valid."""
    rep(kv_offsets(), flags=BLOCK_TABLE_FLAG_KVCACHEINDEX | (1 << 5)).validate(cache(pool=True))
    assert kv_offsets().format == BlockTableFormat.KV_OFFSETS
