"""`describe_trtllm_cache`: a whole TRT-LLM cache (several pools, pool mapping, one offsets table per pool, beams,
host blocks, FP8 scales) as KVX layers, checked against K/V stored by raw byte arithmetic on the pools' memory
(`tests/adapters/engine_ref.py`: setOffsets, the layer pool pointer and getKVLocalIdx, written out by hand); each
layer bound for its KV_OFFSETS table where the kernels address it (`TrtllmLayer.bound`)."""
from __future__ import annotations

import pytest
import torch

from kvx_core.codec import format_of
from kvx_core.descriptors import GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat
from kvx_core.errors import KvxError, Status
from kvx_core.ops import dispatch, reference
from kvx_core.ops.dispatch import gather_kv, paged_decode
from kvx_trtllm import describe_trtllm_cache, layer_views

from ..adapters.engine_ref import rand, trtllm_offset, trtllm_write
from ..kernels.helpers import spy_run_bound
from .oracle import check_attention

T, D = 4, 8


class TwoPools:
    """Two TRT-LLM pools (4 and 2 KV heads, 2 and 1 layers), layers interleaved by kv_cache_pool_mapping, beams
    sharing their first blocks, some blocks in each pool's host (secondary) pool."""

    def __init__(self, dtype=torch.bfloat16, lens=(9, 1, 6), beams=2, seed=0, secondary=True, d=D):
        g = self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.lens, self.w, self.d = dtype, list(lens), beams, d
        self.heads, self.layers_in = [4, 2], [2, 1]
        self.mapping = torch.tensor([[0, 1], [1, 0], [0, 0]])  # model layer -> (pool, layer in pool)
        m = max(-(-n // T) for n in lens) + 1
        self.pools, self.hosts, offs = [], [], []
        for p in range(2):
            n_blocks = len(lens) * beams * m + 2
            shape = (n_blocks, self.layers_in[p], 2, self.heads[p] * T * d)
            self.pools.append(torch.zeros(shape, dtype=dtype))
            self.hosts.append(torch.zeros(shape, dtype=dtype) if secondary else None)
            mem = torch.randperm(n_blocks, generator=g)[:len(lens) * beams * m].view(len(lens), beams, m)
            sec = (torch.rand(mem.shape, generator=g) < 0.3) if secondary else torch.zeros(mem.shape, dtype=torch.bool)
            for s, n in enumerate(lens):
                nb = -(-n // T)
                mem[s, 1:, :nb - 1] = mem[s, :1, :nb - 1]  # beams share all but their last block
                sec[s, 1:, :nb - 1] = sec[s, :1, :nb - 1]
                mem[s, :, nb:] = -1  # past the sequence: null
            offs.append(torch.stack([trtllm_offset(mem, self.layers_in[p], kv, sec) for kv in (0, 1)], dim=2))
        self.offsets = torch.stack(offs).flatten(1, 2)  # [num_pools, seqs * beams, 2, M]
        self.written = []
        for p, li in self.mapping.tolist():  # K/V of every token, by raw byte arithmetic
            seq = torch.cat([torch.full((n * beams,), s) for s, n in enumerate(lens)])
            beam = torch.cat([torch.arange(beams).repeat_interleave(n) for n in lens])
            pos = torch.cat([torch.arange(n).repeat(beams) for n in lens])
            k, v = (rand(g, (seq.numel(), self.heads[p], d), torch.float32) * 3 for _ in range(2))
            first = torch.tensor([0] + [n * beams for n in lens]).cumsum(0)[seq] + pos  # beam 0, same position
            shared = (pos // T < -(-torch.tensor(lens)[seq] // T) - 1).view(-1, 1, 1)
            k, v = (torch.where(shared, x[first], x).to(dtype) for x in (k, v))
            offs4 = self.offsets[p].view(len(lens), beams, 2, -1)
            host = self.hosts[p]
            trtllm_write(self.pools[p].view(torch.uint8).view(-1),
                         host.view(torch.uint8).view(-1) if host is not None else None,
                         offs4, li, self.layers_in[p], T, k, v, seq, beam, pos)
            self.written.append((k, v))

    def describe(self, **kw):
        args = dict(tokens_per_block=T, num_kv_heads=self.heads, head_dim=self.d, pool_mapping=self.mapping,
                    secondary_pools=self.hosts if self.hosts[0] is not None else None, beam_width=self.w)
        args.update(kw)
        return describe_trtllm_cache(self.pools, self.offsets, **args)

    def seq_lens(self) -> SeqLens:
        return SeqLens(torch.tensor(self.lens, dtype=torch.int32))


def _gather(layer, lens: SeqLens, n: int):
    return gather_kv(layer.cache, GatherDesc(layer.table, lens, n))


def test_every_layer_of_two_pools_gathers_the_engine_bytes():
    e = TwoPools()
    pointers = [[p.data_ptr(), h.data_ptr()] for p, h in zip(e.pools, e.hosts, strict=True)]
    layers = e.describe(pool_pointers=torch.tensor(pointers))
    assert [(x.pool, x.layer_in_pool) for x in layers] == [tuple(r) for r in e.mapping.tolist()]
    for layer, (x, (k, v)) in enumerate(zip(layers, e.written, strict=True)):
        assert x.table.format == BlockTableFormat.KV_OFFSETS and x.table.beam_width == 2
        assert x.table.indices.data_ptr() == e.offsets[x.pool].data_ptr()  # TRT-LLM's table itself, zero copy
        bpb = T * e.heads[x.pool] * D * e.dtype.itemsize
        assert x.cache.pool.primary.data_ptr() == e.pools[x.pool].data_ptr() + x.layer_in_pool * 2 * bpb
        out = _gather(x, e.seq_lens(), max(e.lens))
        assert torch.equal(out.key, k) and torch.equal(out.value, v), layer


def test_decode_over_trtllm_tables_equals_attention_over_the_gathered_kv():
    """paged_decode on the KV_OFFSETS layer (beams are sequences) == attention over the K/V gathered above."""
    e = TwoPools(secondary=False, lens=(7, 12), beams=1)
    x = e.describe()[0]
    lens = e.seq_lens()
    q = torch.randn(len(e.lens), 2 * e.heads[x.pool], D, generator=torch.Generator().manual_seed(1)).to(e.dtype)
    out, lse = paged_decode(q, x.cache, x.table, lens)
    kv = _gather(x, lens, max(e.lens))
    check_attention(out, q, kv.key, kv.value, e.lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_layers_come_bound_for_their_offsets_table(kernels_on_cpu, dtype, monkeypatch):
    """On a kernel device (forced here: the kernels under the interpreter) every layer is bound for its KV_OFFSETS
    table, and a step's sync-free plan run as documented (`layer.bound or layer.cache`) takes the bound fast path and
    equals attention over the K/V the engine wrote (FP8: times the layer's scale)."""
    e = TwoPools(dtype=dtype, secondary=False, lens=(7, 12), beams=1, d=64)
    fp8 = dtype == torch.float8_e4m3fn
    s = torch.tensor([0.5, 2.0, 0.125]) if fp8 else torch.ones(3)
    layers = e.describe(kv_scale_quant_orig=s if fp8 else None)
    calls = spy_run_bound(monkeypatch)
    for layer, (x, (k, v)) in enumerate(zip(layers, e.written, strict=True)):
        assert x.bound is not None and x.bound.cache is x.cache and x.bound.table_format == BlockTableFormat.KV_OFFSETS
        h = e.heads[x.pool]
        plan = dispatch.plan_decode(x.table, e.seq_lens(), fmt=format_of(x.cache), num_qo_heads=2 * h, num_kv_heads=h,
                                    head_dim=64, block_size=T, q_dtype=torch.bfloat16, device="cpu", max_seq_len=12,
                                    check=False)
        q = torch.randn(2, 2 * h, 64, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
        out, _ = plan.run(q, x.bound or x.cache, want_lse=False)
        check_attention(out, q, k.float() * s[layer], v.float() * s[layer], e.lens)
    assert len(calls) == len(layers)


def test_bound_layers_take_no_writes(kernels_on_cpu, monkeypatch):
    """Their K and V are one block array: a slot-mapped write would store V over K (writes go through
    `layer_views`)."""
    e = TwoPools(secondary=False, lens=(7, 12), beams=1, d=64)
    x = e.describe()[0]
    before = e.pools[x.pool].clone()
    k = torch.randn(2, e.heads[x.pool], 64).to(torch.bfloat16)
    with pytest.raises(KvxError) as err:
        dispatch.write_kv(x.bound, WriteDesc(KvIoDesc(k, k), SlotMapping(torch.tensor([0, 5]))), check=False)
    assert err.value.status == Status.INVALID_ARGUMENT and torch.equal(e.pools[x.pool], before)


@pytest.mark.parametrize("check", [True, False])
def test_layer_descriptors_take_no_slot_mapped_writes(check):
    """The descriptor of a layer is K and V as one block array: refused before anything is stored, also without
    the value checks (`check=False`, the engines' mode), on the reference and the kernel path alike."""
    e = TwoPools(secondary=False, lens=(7, 12), beams=1, d=64)
    x = e.describe()[0]
    before = e.pools[x.pool].clone()
    k = torch.randn(2, e.heads[x.pool], 64).to(torch.bfloat16)
    for write in (lambda w: dispatch.write_kv(x.cache, w, check=check), lambda w: reference.write_kv(x.cache, w)):
        with pytest.raises(KvxError) as err:
            write(WriteDesc(KvIoDesc(k, k), SlotMapping(torch.tensor([0, 5]))))
        assert err.value.status == Status.INVALID_ARGUMENT and "layer_views" in err.value.message
        assert torch.equal(e.pools[x.pool], before)


def test_layers_the_kernels_cannot_address_are_not_bound(monkeypatch):
    assert all(x.bound is None for x in TwoPools(secondary=False, d=64).describe())  # CPU pools: no kernel device
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)  # binding launches nothing
    assert all(x.bound is None for x in TwoPools(d=64).describe())  # host (secondary) pools: the reference reads them


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pools_take_the_per_layer_scale(dtype):
    e = TwoPools(dtype=dtype, secondary=False)
    s = torch.tensor([0.5, 2.0, 0.125])
    layers = e.describe(kv_scale_quant_orig=s, kv_scale_orig_quant=1 / s)
    for layer, (x, (k, v)) in enumerate(zip(layers, e.written, strict=True)):
        out = _gather(x, e.seq_lens(), max(e.lens))
        assert torch.equal(out.key, k.float() * s[layer]) and torch.equal(out.value, v.float() * s[layer])


@pytest.mark.parametrize("kw,status,words", [
    ({"kv_factor": 1}, Status.UNSUPPORTED, "MLA"),
    ({"num_kv_heads": [4]}, Status.INVALID_ARGUMENT, "2 pools"),
    ({"pool_mapping": torch.tensor([[0, 0], [0, 0], [1, 0]])}, Status.INVALID_ARGUMENT, "two layers"),
    ({"pool_mapping": torch.tensor([[0, 2], [1, 0], [0, 0]])}, Status.INVALID_ARGUMENT, "names no layer"),
    ({"pool_pointers": torch.zeros(2, 2, dtype=torch.int64)}, Status.INVALID_ARGUMENT, "base addresses"),
    ({"pool_pointers": torch.zeros(2, 2, 2, dtype=torch.int64)}, Status.INVALID_ARGUMENT, "NVFP4"),
    ({"tokens_per_block": 3}, Status.INVALID_ARGUMENT, "power of two"),
    ({"beam_width": 4}, Status.INVALID_ARGUMENT, "beams"),  # 3 sequences x 2 beams = 6 rows
])
def test_bad_descriptions_are_refused(kw, status, words):
    e = TwoPools(secondary=False)
    with pytest.raises(KvxError) as err:
        e.describe(**kw)
    assert err.value.status == status and words in str(err.value)


def test_fp8_needs_consistent_scales():
    e = TwoPools(dtype=torch.float8_e4m3fn, secondary=False)
    with pytest.raises(KvxError, match="kv_scale_quant_orig"):
        e.describe()
    with pytest.raises(KvxError, match="1 / kv_scale_quant_orig"):
        e.describe(kv_scale_quant_orig=[1.0, 1.0, 1.0], kv_scale_orig_quant=[1.0, 0.5, 1.0])
    with pytest.raises(KvxError, match="finite and positive"):
        e.describe(kv_scale_quant_orig=[1.0, 0.0, 1.0])
    with pytest.raises(KvxError, match="scale_pools are NVFP4"):
        e.describe(kv_scale_quant_orig=[1.0] * 3, scale_pools=e.pools)


def test_layer_views_are_the_pool_memory():
    e = TwoPools(secondary=False)
    views = layer_views(e.pools[0], tokens_per_block=T, num_kv_heads=4, head_dim=D)
    assert len(views) == 2
    pool = e.pools[0].view(-1, 2, 2, 4, T, D)  # [block, layer, kv, H, T, D]
    for li, c in enumerate(views):
        assert c.k.tensor.data_ptr() == pool[0, li, 0].data_ptr() and c.v.tensor.data_ptr() == pool[0, li, 1].data_ptr()
    with pytest.raises(KvxError, match="K-only"):
        layer_views(e.pools[0][:, :, :1], tokens_per_block=T, num_kv_heads=4, head_dim=D)
