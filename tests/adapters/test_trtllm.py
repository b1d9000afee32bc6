"""TensorRT-LLM adapters: KVBlockArray pools written / read by raw byte arithmetic on flat uint8 pools."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvx_adapters import trtllm, vllm
from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat, Layout
from kvx_core.errors import KvxError, Status
from kvx_core.ops.reference import gather_kv, write_kv

from .engine_ref import (
    DTYPES,
    make_workload,
    rand,
    storage_bytes,
    trtllm_offset,
    trtllm_read,
    trtllm_write,
    vllm_allocate,
    vllm_reshape_and_cache_flash,
)

SETTINGS = settings(max_examples=20, deadline=None)

geometry = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 33), min_size=1, max_size=3),
    "tokens_per_block": st.sampled_from([1, 2, 4, 8, 16]),
    "heads": st.integers(1, 3),
    "head_dim": st.sampled_from([4, 8, 16]),
    "dtype": st.sampled_from(DTYPES),
    "num_layers": st.integers(1, 3),
    "beam_width": st.integers(1, 3),
    "use_secondary": st.booleans(),
    "bytes_pool": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
})


class Engine:
    """A TRT-LLM-like setup: pools `{blocks, num_layers, 2, H*T*D}` (kvCacheManager.cpp allocatePools),
    per-(request, beam) block ids where beams share all but their last block, offsets as setOffsets
    stores them (layer 0; the layer goes through the pool pointer) with bit 31 for host blocks."""

    def __init__(self, g):
        self.g = g
        gen = self.gen = torch.Generator().manual_seed(g["seed"])
        self.t, self.h, self.d, self.dt = g["tokens_per_block"], g["heads"], g["head_dim"], g["dtype"]
        self.L, self.w, self.lens = g["num_layers"], g["beam_width"], g["lens"]
        self.layer = int(torch.randint(0, self.L, (1,), generator=gen))
        need = [(n + self.t - 1) // self.t for n in self.lens]
        m = max(need + [1])
        ids = []
        for n in need:  # per request: shared blocks + one own last block per beam
            shared = max(n - 1, 0) if self.w > 1 else n
            own = (n - shared) * self.w
            ids.append((shared, own))
        total = sum(s + o for s, o in ids)
        self.p1, self.p2 = total + 2, (total + 2 if g["use_secondary"] else 0)
        pick_sec = (torch.rand(total, generator=gen) < 0.4 if g["use_secondary"]
                    else torch.zeros(total, dtype=torch.bool))
        prim_perm, sec_perm = torch.randperm(self.p1, generator=gen), torch.randperm(max(self.p2, 1), generator=gen)
        self.mem = torch.full((len(self.lens), self.w, m), -1, dtype=torch.int64)
        self.sec = torch.zeros((len(self.lens), self.w, m), dtype=torch.bool)
        at = 0
        for s, ((shared, _own), n) in enumerate(zip(ids, need, strict=True)):
            for j in range(shared):
                self.sec[s, :, j] = pick_sec[at]
                self.mem[s, :, j] = (sec_perm if pick_sec[at] else prim_perm)[at]
                at += 1
            for w in range(self.w):
                for j in range(shared, n):
                    self.sec[s, w, j] = pick_sec[at]
                    self.mem[s, w, j] = (sec_perm if pick_sec[at] else prim_perm)[at]
                    at += 1
        self.offsets = torch.stack([trtllm_offset(self.mem, self.L, kv, self.sec) for kv in (0, 1)], dim=2)
        shape = (self.p1, self.L, 2, self.h * self.t * self.d)
        self.pool = torch.zeros(shape, dtype=self.dt)
        self.host = torch.zeros((self.p2,) + shape[1:], dtype=self.dt) if self.p2 else None

    def bytes(self, pool):
        return pool.view(torch.uint8).view(-1) if pool is not None else torch.zeros(0, dtype=torch.uint8)

    def tokens(self):
        """All (seq, beam, pos) in gather order; K/V equal across beams inside shared blocks."""
        seq = torch.cat([torch.full((n * self.w,), s) for s, n in enumerate(self.lens)]).to(torch.int64)
        beam = torch.cat([torch.arange(self.w).repeat_interleave(n) for n in self.lens]).to(torch.int64)
        pos = torch.cat([torch.arange(n).repeat(self.w) for n in self.lens]).to(torch.int64)
        k = rand(self.gen, (seq.numel(), self.h, self.d), self.dt)
        v = rand(self.gen, (seq.numel(), self.h, self.d), self.dt)
        blk = pos // self.t
        shared = ((self.mem[seq, beam, blk] == self.mem[seq, 0, blk])
                  & (self.sec[seq, beam, blk] == self.sec[seq, 0, blk]))
        starts = torch.cumsum(torch.tensor([0] + [n * self.w for n in self.lens[:-1]]), 0)
        first = starts[seq] + pos  # index of beam 0's token at the same position
        k = torch.where(shared.view(-1, 1, 1), k[first], k)
        v = torch.where(shared.view(-1, 1, 1), v[first], v)
        return seq, beam, pos, k, v


@SETTINGS
@given(g=geometry)
def test_engine_bytes_write_kvx_kv_offsets_gather(g):
    e = Engine(g)
    seq, beam, pos, k, v = e.tokens()
    trtllm_write(e.bytes(e.pool), e.bytes(e.host), e.offsets, e.layer, e.L, e.t, k, v, seq, beam, pos)

    prim = e.bytes(e.pool) if g["bytes_pool"] else e.pool
    sec = (e.bytes(e.host) if g["bytes_pool"] else e.host) if e.host is not None else None
    cache = trtllm.from_trtllm_pool(prim, tokens_per_block=e.t, num_kv_heads=e.h, head_dim=e.d, layer=e.layer,
                                    cache_dtype=e.dt if g["bytes_pool"] else None, secondary_pool=sec)
    assert cache.k.layout == Layout.HND and cache.pool.bytes_per_block == trtllm.bytes_per_block(e.t, e.h, e.d, e.dt)
    bpb = cache.pool.bytes_per_block
    assert cache.pool.primary.data_ptr() == e.pool.data_ptr() + e.layer * 2 * bpb  # attentionOp intra_pool_offset
    table = trtllm.from_trtllm_offsets(e.offsets)
    assert table.format == BlockTableFormat.KV_OFFSETS and table.beam_width == e.w
    assert table.indices.data_ptr() == e.offsets.data_ptr()
    out = gather_kv(cache, GatherDesc(table, SeqLens(torch.tensor(e.lens)), max(e.lens)))
    assert torch.equal(out.key, k) and torch.equal(out.value, v)

    # the same memory with absolute offsets (mem * L + layer) * 2 + kv from the unshifted pool base
    if not g["use_secondary"]:
        absolute = trtllm.kv_offsets_from_packed(e.mem[:, 0], num_layers=e.L, layer=e.layer) if e.w == 1 else None
        if absolute is not None:
            base = trtllm.from_trtllm_pool(e.pool, tokens_per_block=e.t, num_kv_heads=e.h, head_dim=e.d)
            out2 = gather_kv(base, GatherDesc(trtllm.from_trtllm_offsets(absolute), SeqLens(torch.tensor(e.lens)),
                                              max(e.lens)))
            assert torch.equal(out2.key, k) and torch.equal(out2.value, v)


@SETTINGS
@given(g=geometry)
def test_kvx_layer_write_engine_bytes_read(g):
    gen = torch.Generator().manual_seed(g["seed"])
    t, h, d, dt, L = g["tokens_per_block"], g["heads"], g["head_dim"], g["dtype"], g["num_layers"]
    layer = L - 1
    wl = make_workload(gen, g["lens"], t, h, d, dt)
    pool = torch.zeros(wl.num_blocks, L, 2, h * t * d, dtype=dt)
    src = pool.view(torch.uint8).view(-1) if g["bytes_pool"] else pool
    cache = trtllm.from_trtllm_layer(src, layer, tokens_per_block=t, num_kv_heads=h, head_dim=d,
                                     num_layers=L, cache_dtype=dt if g["bytes_pool"] else None)
    assert cache.k.layout == Layout.HND or h == 1 or t == 1
    write_kv(cache, WriteDesc(KvIoDesc(wl.key, wl.value), SlotMapping(wl.slots)))

    lens = SeqLens(torch.tensor(wl.lens))
    offsets = trtllm.kv_offsets_from_packed(wl.table, num_layers=L, seq_lens=lens, tokens_per_block=t)
    ok = wl.seq_ids >= 0
    k, v = trtllm_read(pool.view(torch.uint8).view(-1), None, offsets, layer, L, t, h, d, dt,
                       wl.seq_ids[ok], torch.zeros_like(wl.seq_ids[ok]), wl.positions[ok])
    assert torch.equal(k, wl.key[ok]) and torch.equal(v, wl.value[ok])
    for other in range(L):
        if other != layer:
            assert not pool[:, other].any()

    arr = trtllm.to_trtllm_block_array(cache, BlockTable.packed(wl.table), seq_lens=lens)
    assert torch.equal(arr.offsets, offsets)  # TRT-LLM's own table ...
    assert arr.primary.data_ptr() == pool.data_ptr() + layer * 2 * arr.bytes_per_block  # ... at the layer pointer
    ids, sec = trtllm.packed_from_kv_offsets(offsets, num_layers=L)
    used = ids >= 0
    assert torch.equal(ids[used], wl.table.to(torch.int64)[used]) and not sec.any()


def test_vllm_hnd_cache_as_kv_block_array():
    """A vLLM flash_attn HND cache is KVBlockArray-addressable: K block id, V block N + id."""
    gen = torch.Generator().manual_seed(3)
    wl = make_workload(gen, [9, 0, 21], 8, 2, 16, torch.bfloat16)
    kv = vllm_allocate("flash_attn", "HND", wl.num_blocks, 8, 2, 16, torch.bfloat16)
    vllm_reshape_and_cache_flash(wl.key, wl.value, kv[0], kv[1], wl.slots)
    cache = vllm.from_vllm_kv_cache(kv)
    lens = SeqLens(torch.tensor(wl.lens))
    arr = trtllm.to_trtllm_block_array(cache, vllm.block_table_from_vllm(wl.table), seq_lens=lens, beam_width=2)
    assert arr.primary.data_ptr() == kv.data_ptr() and arr.offsets.shape == (3, 2, 2, wl.table.shape[1])
    ok = wl.seq_ids >= 0
    k, v = trtllm_read(storage_bytes(kv), None, arr.offsets, 0, 1, 8, 2, 16, torch.bfloat16,
                       wl.seq_ids[ok], torch.ones_like(wl.seq_ids[ok]), wl.positions[ok])
    assert torch.equal(k, wl.key[ok]) and torch.equal(v, wl.value[ok])
    back = trtllm.from_trtllm_pool(arr.primary, tokens_per_block=8, num_kv_heads=2, head_dim=16)
    out = gather_kv(back, GatherDesc(trtllm.from_trtllm_offsets(arr.offsets), lens, 64))
    ek, ev = wl.expected()
    per_beam = [x for part in zip(ek.split(wl.lens), ek.split(wl.lens), strict=True) for x in part]  # (seq, beam) order
    assert torch.equal(out.key, torch.cat(per_beam))
    per_beam = [x for part in zip(ev.split(wl.lens), ev.split(wl.lens), strict=True) for x in part]
    assert torch.equal(out.value, torch.cat(per_beam))


def test_nhd_cache_is_not_a_kv_block_array():
    kv = vllm_allocate("flash_attn", "NHD", 4, 8, 2, 16, torch.float16)
    with pytest.raises(KvxError) as e:
        trtllm.to_trtllm_block_array(vllm.from_vllm_kv_cache(kv),
                                     BlockTable.packed(torch.zeros(1, 1, dtype=torch.int32)))
    assert e.value.status == Status.UNSUPPORTED


def test_get_buffers_views_and_zero_copy():
    t, h, d, L = 4, 2, 8, 3
    pool = torch.zeros(6, L, 2, h * t * d, dtype=torch.float16)
    for kv_layout in ("NHD", "HND"):
        # resource_manager.py get_buffers: [blocks, kv_factor, T, H, D] / [blocks, kv_factor, H, T, D]
        inner = (t, h, d) if kv_layout == "NHD" else (h, t, d)
        buf = pool[:, 1].unflatten(2, inner)
        cache = trtllm.from_trtllm_buffers(buf, kv_layout=kv_layout)
        assert cache.k.layout == Layout[kv_layout] and cache.k.tensor.data_ptr() == buf[:, 0].data_ptr()
        k = torch.randn(1, h, d).half()
        write_kv(cache, WriteDesc(KvIoDesc(k, -k), SlotMapping(torch.tensor([5 * t + 3]))))
        got = buf[5, 0, 3] if kv_layout == "NHD" else buf[5, 0, :, 3]
        assert torch.equal(got, k[0])
        pool.zero_()
    layer = trtllm.from_trtllm_layer(pool, 2, tokens_per_block=t, num_kv_heads=h, head_dim=d)
    pool[4, 2, 1, (1 * t + 2) * d + 5] = 7.0  # engine write: V, block 4, head 1, token 2, dim 5
    assert layer.v.tensor[4, 1, 2, 5] == 7.0


@pytest.mark.parametrize("tpb", [3, 6, 12, 24])
def test_non_power_of_two_tokens_per_block_rejected(tpb):
    pool = torch.zeros(4, 2, 2, 2 * tpb * 8)
    calls = [
        lambda: trtllm.from_trtllm_pool(pool, tokens_per_block=tpb, num_kv_heads=2, head_dim=8),
        lambda: trtllm.from_trtllm_layer(pool, 0, tokens_per_block=tpb, num_kv_heads=2, head_dim=8),
        lambda: trtllm.from_trtllm_buffers(pool[:, 0].unflatten(2, (tpb, 2, 8))),
        lambda: trtllm.kv_offsets_from_packed(torch.zeros(1, 2, dtype=torch.int32), num_layers=2,
                                              seq_lens=SeqLens(torch.tensor([3])), tokens_per_block=tpb),
    ]
    for call in calls:
        with pytest.raises(KvxError) as e:
            call()
        assert e.value.status == Status.INVALID_ARGUMENT and "power of two" in e.value.message


def test_offsets_round_trip_and_errors():
    ids = torch.tensor([[3, 0, -1], [1, 2, 5]], dtype=torch.int32)
    o = trtllm.kv_offsets_from_packed(ids, num_layers=4, layer=1, beam_width=2,
                                      secondary=torch.tensor([[True, False, False], [False, False, True]]))
    assert o.shape == (2, 2, 2, 3) and o.dtype == torch.int32
    assert o[0, 1, 0, 0].item() == ((3 * 4 + 1) * 2) | -(1 << 31) and o[0, 0, 1, 1].item() == 3
    assert o[0, 0, 0, 2].item() == -1
    back, sec = trtllm.packed_from_kv_offsets(o, num_layers=4, layer=1, beam=1)
    assert back.tolist() == [[3, 0, -1], [1, 2, 5]] and sec.tolist() == [[True, False, False], [False, False, True]]
    bad = o.clone()
    bad[1, 0, 1, 0] += 2  # V names another block than K
    with pytest.raises(KvxError) as e:
        trtllm.packed_from_kv_offsets(bad, num_layers=4, layer=1)
    assert e.value.status == Status.INVALID_ARGUMENT
    t3 = trtllm.from_trtllm_offsets(o.view(4, 2, 3), beam_width=2)
    assert t3.beam_width == 2 and t3.seq_count == 2 and t3.indices.data_ptr() == o.data_ptr()
    assert trtllm.seq_lens_from_trtllm(torch.tensor([5, 5, 0, 0]), beam_width=2).lengths.tolist() == [5, 0]
    with pytest.raises(KvxError):
        trtllm.seq_lens_from_trtllm(torch.tensor([5, 4]), beam_width=2)


@pytest.mark.parametrize("bad", [
    lambda: trtllm.from_trtllm_pool(torch.zeros(4, 2, 2, 64).transpose(0, 3), tokens_per_block=4, num_kv_heads=2,
                                    head_dim=8),
    lambda: trtllm.from_trtllm_pool(torch.zeros(4, 2, 2, 64), tokens_per_block=4, num_kv_heads=2, head_dim=4),
    lambda: trtllm.from_trtllm_pool(torch.zeros(4, 2, 2, 64), tokens_per_block=4, num_kv_heads=2, head_dim=8,
                                    layer=2),
    lambda: trtllm.from_trtllm_pool(torch.zeros(64, dtype=torch.uint8), tokens_per_block=4, num_kv_heads=2,
                                    head_dim=8),
    lambda: trtllm.from_trtllm_pool(torch.zeros(4, 2, 2, 64), tokens_per_block=4, num_kv_heads=2, head_dim=8,
                                    kv_factor=3),
    lambda: trtllm.from_trtllm_offsets(torch.zeros(2, 1, 2, 4, dtype=torch.int64)),
    lambda: trtllm.from_trtllm_offsets(torch.zeros(2, 1, 3, 4, dtype=torch.int32)),
    lambda: trtllm.from_trtllm_offsets(torch.zeros(3, 2, 4, dtype=torch.int32), beam_width=2),
    lambda: trtllm.from_trtllm_layer(torch.zeros(4 * 2 * 2 * 64), 0, tokens_per_block=4, num_kv_heads=2, head_dim=8),
    lambda: trtllm.from_trtllm_layer(torch.zeros(4, 2, 2, 64), 2, tokens_per_block=4, num_kv_heads=2, head_dim=8),
])
def test_bad_input_is_a_kvx_error(bad):
    with pytest.raises(KvxError) as e:
        bad()
    assert e.value.status == Status.INVALID_ARGUMENT


def test_k_only_buffers_unsupported():
    with pytest.raises(KvxError) as e:
        trtllm.from_trtllm_buffers(torch.zeros(4, 1, 4, 2, 8))
    assert e.value.status == Status.UNSUPPORTED


def test_gather_rejects_secondary_reference_without_secondary_pool():
    pool = torch.zeros(4, 1, 2, 2 * 4 * 8)
    cache = trtllm.from_trtllm_pool(pool, tokens_per_block=4, num_kv_heads=2, head_dim=8)
    o = torch.stack([trtllm_offset(torch.tensor([[1]]), 1, kv, True) for kv in (0, 1)], dim=1).unsqueeze(1)
    with pytest.raises(KvxError) as e:
        gather_kv(cache, GatherDesc(trtllm.from_trtllm_offsets(o), SeqLens(torch.tensor([2])), 8))
    assert e.value.status == Status.INVALID_ARGUMENT
