"""Dual pools of `PagedKVCache`: a write lands in the data AND scale pools at the allocated block ids and
nowhere else (checked byte for byte over every storage, page padding included); page-buffer and
separate pools hold bit-identical bytes and decode identically; `descriptor(layer)` records the format."""
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.codec import format_of
from kvx_core.enums import QUANT_FLAG_HADAMARD, QUANT_FLAG_MX_SCALE_FLOOR, DType, Layout, QuantFormat
from kvx_core.formats import list_formats
from kvx_core.ops.attention import paged_decode

from .batch import make_batch
from .oracle import as_bytes, same_view, storages

H, D, BS = 2, 64, 4


@pytest.mark.parametrize("page_buffer", [False, True], ids=["separate", "page_buffer"])
@pytest.mark.parametrize("fmt", list_formats())
def test_write_updates_both_pools_at_allocated_blocks_only(fmt, page_buffer):
    cache = PagedKVCache(fmt, num_layers=2, num_blocks=8, block_size=BS, num_kv_heads=H, head_dim=D,
                         page_buffer=page_buffer)
    gen = torch.Generator().manual_seed(5)
    bufs = storages(cache)
    for buf in bufs.values():  # random bytes everywhere, so any stray write shows
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    if cache.layers[1].k_global is not None:
        cache.set_global_scales(1, 0.75, 1.25)
    a = cache.allocator
    other = a.allocate(3)
    a.free(other[1:])
    blocks = a.allocate(2)  # reused ids, not the low contiguous ones
    assert not set(blocks) & {other[0]}

    # 5 tokens: block0 offsets 0..3, block1 offset 2; plus two skipped (-1) tokens with huge values
    slots = [blocks[0] * BS + i for i in range(BS)] + [-1, blocks[1] * BS + 2, -1]
    k = torch.randn(len(slots), H, D, generator=gen)
    v = torch.randn(len(slots), H, D, generator=gen)
    k[[4, 6]], v[[4, 6]] = 1e4, -1e4
    expect = {ptr: buf.clone() for ptr, buf in bufs.items()}
    p, f = cache.layers[1], cache.format
    for x, enc, data, scales, g in ((k, f.encode_k, p.k_data, p.k_scales, p.k_global),
                                    (v, f.encode_v, p.v_data, p.v_scales, p.v_global)):
        payload, sc = enc(x, g)
        for t, s in enumerate(slots):
            if s < 0:
                continue
            b, o = divmod(s, BS)
            same_view(data, expect[data.untyped_storage().data_ptr()])[b, :, o] = payload[t]
            if scales is not None:
                same_view(scales, expect[scales.untyped_storage().data_ptr()])[b, :, o] = sc[t]
    cache.write(1, k, v, torch.tensor(slots))
    for ptr, buf in bufs.items():
        changed = (buf != expect[ptr]).nonzero().flatten()
        assert changed.numel() == 0, f"bytes {changed[:8].tolist()} differ from the expected write"
    assert len(bufs) == (2 if page_buffer else sum(t is not None for t in (p.k_data, p.v_data, p.k_scales,
                                                                          p.v_scales)) * 2)


@pytest.mark.parametrize("fmt", list_formats())
def test_page_buffer_and_separate_pools_are_bit_identical(fmt):
    lens = [5, 0, 13]
    sep = make_batch(fmt, lens, num_kv_heads=H, head_dim=D, block_size=BS, page_buffer=False, seed=9)
    pag = make_batch(fmt, lens, num_kv_heads=H, head_dim=D, block_size=BS, page_buffer=True, seed=9)
    assert sep.blocks == pag.blocks
    for layer in range(2):
        a, b = sep.cache.layers[layer], pag.cache.layers[layer]
        for name in ("k_data", "v_data", "k_scales", "v_scales"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None), name
            if ta is not None:
                assert ta.dtype == tb.dtype and ta.shape == tb.shape
                assert torch.equal(as_bytes(ta), as_bytes(tb)), (layer, name)
    ka, va = sep.cache.gather(1, sep.table, sep.seq_lens.lengths)
    kb, vb = pag.cache.gather(1, pag.table, pag.seq_lens.lengths)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    q = torch.randn(len(lens), 2 * H, D, generator=torch.Generator().manual_seed(1))
    oa, la = paged_decode(q, sep.cache.descriptor(1), sep.block_table, sep.seq_lens)
    ob, lb = paged_decode(q, pag.cache.descriptor(1), pag.block_table, pag.seq_lens)
    assert torch.equal(oa, ob) and torch.equal(la, lb)


# name -> (QuantFormat, group size (None: head_dim), K data dtype, V data dtype,
#          (K scale dtype, bytes per token-head), (V scale dtype, bytes per token-head)); 0 bytes: no scale pool
E4, UE, U8 = DType.F8_E4M3, DType.UE8M0, DType.U8
QUANT = {
    "fp8_e4m3": (QuantFormat.FP8_E4M3, None, DType.F8_E4M3, DType.F8_E4M3, (None, 0), (None, 0)),
    "fp8_e5m2": (QuantFormat.FP8_E5M2, None, DType.F8_E5M2, DType.F8_E5M2, (None, 0), (None, 0)),
    "int8": (QuantFormat.INT8, None, DType.U8, DType.U8, (U8, 4), (U8, 4)),
    "int4": (QuantFormat.INT4, None, DType.INT4X2, DType.INT4X2, (U8, 4), (U8, 4)),
    "mxfp4": (QuantFormat.MXFP4, 16, DType.FP4_E2M1X2, DType.FP4_E2M1X2, (UE, D // 16), (UE, D // 16)),
    "mxfp4_32": (QuantFormat.MXFP4, 32, DType.FP4_E2M1X2, DType.FP4_E2M1X2, (UE, D // 32), (UE, D // 32)),
    "nvfp4": (QuantFormat.NVFP4, 16, DType.FP4_E2M1X2, DType.FP4_E2M1X2, (E4, D // 16), (E4, D // 16)),
    "k8v4": (QuantFormat.K8V4, 16, DType.F8_E4M3, DType.FP4_E2M1X2, (None, 0), (E4, D // 16)),
}
USES_GLOBAL = {"fp8_e4m3": (True, True), "fp8_e5m2": (True, True), "nvfp4": (True, True), "k8v4": (True, True)}
PLAIN = {"bf16": DType.BF16, "fp16": DType.F16, "fp32": DType.F32}


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor_g", "per_head_g"])
@pytest.mark.parametrize("page_buffer", [False, True], ids=["separate", "page_buffer"])
@pytest.mark.parametrize("fmt", list_formats())
def test_descriptor_validates_and_records_format(fmt, page_buffer, per_head):
    cache = PagedKVCache(fmt, num_layers=2, num_blocks=5, block_size=BS, num_kv_heads=H, head_dim=D,
                         page_buffer=page_buffer, per_head_global_scale=per_head)
    base = fmt.removesuffix("_rot").removesuffix("_floor")
    desc = cache.descriptor(1)
    desc.validate()
    p = cache.layers[1]
    for td, pool in ((desc.k, p.k_data), (desc.v, p.v_data)):
        assert (td.data_ptr, td.stride) == (pool.data_ptr(), pool.stride())
    assert desc.k.layout == desc.v.layout == Layout.HND
    assert (desc.num_blocks, desc.block_size, desc.num_kv_heads, desc.head_dim) == (5, BS, H, D)
    assert format_of(desc).name == fmt
    if base in PLAIN:
        assert desc.quant is None and desc.k.dtype == desc.v.dtype == PLAIN[base]
        return
    qf, group, kdt, vdt, ks, vs = QUANT[base]
    q = desc.quant
    assert (q.format, q.group_size, q.k_data_dtype, q.v_data_dtype) == (qf, group or D, kdt, vdt)
    assert q.flags == (QUANT_FLAG_HADAMARD if fmt.endswith("_rot") else 0) | \
        (QUANT_FLAG_MX_SCALE_FLOOR if fmt.endswith("_floor") else 0)
    for sdesc, pool, (sdt, width) in ((q.k_scales, p.k_scales, ks), (q.v_scales, p.v_scales, vs)):
        if width == 0:
            assert sdesc is None and pool is None
        else:
            assert (sdesc.data_ptr, sdesc.stride) == (pool.data_ptr(), pool.stride())  # describes the pool itself
            assert sdesc.layout == Layout.HND and sdesc.dtype == sdt
            assert sdesc.shape == (5, H, BS, width)  # same block ids as the data pool
    uses_k, uses_v = USES_GLOBAL.get(base, (False, False))
    if not uses_k:
        assert q.k_global_scale is None and q.v_global_scale is None
        return
    n = H if per_head else 1
    gk, gv = torch.arange(1, n + 1) * 0.5, torch.arange(1, n + 1) * 0.25
    cache.set_global_scales(1, gk, gv)
    q = cache.descriptor(1).quant
    assert q.global_scale_count == n
    assert torch.equal(q.k_global_scale, gk.float()) and torch.equal(q.v_global_scale, gv.float())
    assert torch.equal(cache.descriptor(0).quant.k_global_scale, torch.ones(n))  # other layer untouched

