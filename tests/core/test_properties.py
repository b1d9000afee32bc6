"""Property tests of the reference ops and block-table encodings (spec §4, §5, §7).

Write-then-gather returns exactly what was written (the K/V given to write_kv, cast to the cache
dtype, in sequence order, cut at max_seq_len) for random geometries, every layout (incl. CUSTOM
transposed / padded allocations and non-canonical strides of the named layouts), every block-table
format and dtypes F16/BF16/F32; invalid and negative slots change no byte of the cache. Conversions
between encodings round-trip and match hand computations.
"""
from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from kvx_core import block_tables as bt
from kvx_core.descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    PoolDesc,
    SeqLens,
    SlotMapping,
    WriteDesc,
    memory_of,
)
from kvx_core.enums import KVCACHEINDEX_NULL, KVCACHEINDEX_SECONDARY_BIT, Layout
from kvx_core.ops.reference import gather_kv, write_kv

from .helpers import ALL_LAYOUTS, PERMS, build, divisors, raw_bytes

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
INDEX = st.sampled_from([torch.int32, torch.int64])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def tensor_layouts(draw, d: int, layout: Layout | None = None):
    """(layout, pack, perm, pad) of one cache tensor."""
    layout = draw(st.sampled_from(ALL_LAYOUTS)) if layout is None else layout
    pack = draw(st.sampled_from(divisors(d))) if layout == Layout.HND_PACKED else 1
    perm = draw(st.sampled_from(PERMS)) if layout == Layout.CUSTOM else (0, 1, 2, 3)
    return layout, pack, perm, draw(st.integers(0, 1))


def allocate(draw, gen, lens, block_size, extra_blocks, extra_cols, fill):
    """A PACKED table giving each sequence ceil(len / B) distinct physical blocks (random order);
    entries past a sequence's blocks are `fill` (-1 or a random in-range id: never read)."""
    need = [cdiv(n, block_size) for n in lens]
    n_blocks = max(1, sum(need) + extra_blocks)
    m = (max(need) if need else 0) + extra_cols
    ids = torch.randperm(n_blocks, generator=gen)
    table = torch.full((len(lens), m), -1, dtype=torch.int64) if fill < 0 else \
        torch.randint(0, n_blocks, (len(lens), m), generator=gen)
    used = 0
    for s, k in enumerate(need):
        table[s, :k] = ids[used:used + k]
        used += k
    return table, n_blocks


def make_cache_tensor(x: torch.Tensor, spec) -> torch.Tensor:
    layout, pack, perm, pad = spec
    return build(x, layout, pack, perm, pad)


def slots_by_hand(table, seq_ids, positions, block_size, invalid_slot):
    out = []
    for s, p in zip(seq_ids.tolist(), positions.tolist(), strict=True):
        out.append(invalid_slot if s < 0 or p < 0 else int(table[s, p // block_size]) * block_size + p % block_size)
    return torch.tensor(out, dtype=torch.int64)


# ----------------------------------------------------------------------------- write then gather
@SETTINGS
@given(data=st.data(),
       block_size=st.sampled_from([1, 2, 3, 4, 5, 8, 16]),
       heads=st.integers(1, 3),
       head_dim=st.sampled_from([1, 2, 4, 6, 8, 12]),
       cache_dtype=st.sampled_from(DTYPES),
       io_dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_write_then_gather_returns_what_was_written(data, block_size, heads, head_dim, cache_dtype, io_dtype, seed):
    draw = data.draw
    gen = torch.Generator().manual_seed(seed)
    B, H, D = block_size, heads, head_dim
    lens = draw(st.lists(st.integers(0, 3 * B + 1), min_size=draw(st.sampled_from([1, 1, 1, 0])), max_size=5),
                label="lens")
    table, N = allocate(draw, gen, lens, B, draw(st.integers(0, 3)), draw(st.integers(0, 2)),
                        draw(st.sampled_from([-1, 0])))
    table = table.to(draw(INDEX, label="table dtype"))
    k_spec, v_spec = draw(tensor_layouts(D), label="K layout"), draw(tensor_layouts(D), label="V layout")

    # the cache starts full of other data; the oracle of its final bytes is built the same way
    x_k = torch.randn(N, B, H, D, generator=gen).to(cache_dtype)
    x_v = torch.randn(N, B, H, D, generator=gen).to(cache_dtype)
    k, v = make_cache_tensor(x_k, k_spec), make_cache_tensor(x_v, v_spec)
    cache = CacheDesc.from_torch(k, v, block_size=B, num_kv_heads=H, head_dim=D, k_layout=k_spec[0],
                                 v_layout=v_spec[0])

    # tokens of every sequence plus padding, shuffled, written in one or two batches
    keys = [torch.randn(n, H, D, generator=gen).to(io_dtype) for n in lens]
    values = [torch.randn(n, H, D, generator=gen).to(io_dtype) for n in lens]
    n_pad = draw(st.integers(0, 4), label="padding tokens")
    seq_ids = torch.tensor([s for s, n in enumerate(lens) for _ in range(n)] + [-1] * n_pad, dtype=torch.int64)
    positions = torch.tensor([p for n in lens for p in range(n)] + [-1] * n_pad, dtype=torch.int64)
    key = torch.cat(keys + [torch.randn(n_pad, H, D, generator=gen).to(io_dtype)])
    value = torch.cat(values + [torch.randn(n_pad, H, D, generator=gen).to(io_dtype)])
    order = torch.randperm(len(seq_ids), generator=gen)
    seq_ids, positions, key, value = seq_ids[order], positions[order], key[order], value[order]
    invalid_slot = draw(st.sampled_from([-1, -7, N * B, N * B + 5, 2**31 - 1]), label="invalid_slot")
    slots = bt.slot_mapping(table, seq_ids, positions, B, invalid_slot)
    assert torch.equal(slots, slots_by_hand(table, seq_ids, positions, B, invalid_slot))
    if n_pad and draw(st.booleans(), label="other negative pads"):
        pad_at = (seq_ids < 0).nonzero().flatten()
        slots[pad_at[::2]] = -torch.randint(1, 2**31, (len(pad_at[::2]),), generator=gen)
    slots = slots.to(draw(INDEX, label="slot dtype"))
    cut = draw(st.integers(0, len(slots)), label="batch split")
    for name, spec in (("K", k_spec), ("V", v_spec)):
        event(f"{name} layout {spec[0].name}{' padded' if spec[3] else ''}")
    event(f"sequences: {len(lens)}, a zero-length one: {0 in lens}")
    event(f"invalid_slot {'negative' if invalid_slot < 0 else 'beyond the cache'}")
    for sl in (slice(0, cut), slice(cut, None)):
        write_kv(cache, WriteDesc(KvIoDesc(key[sl], value[sl]), SlotMapping(slots[sl], invalid_slot)))

    # every byte of both caches (padding of over-allocated storage included) is as expected
    for x, tensor, spec, toks in ((x_k, k, k_spec, keys), (x_v, v, v_spec, values)):
        expect = x.clone()
        for s, n in enumerate(lens):
            for p in range(n):
                expect[int(table[s, p // B]), p % B] = toks[s][p].to(cache_dtype)
        assert torch.equal(raw_bytes(tensor), raw_bytes(make_cache_tensor(expect, spec)))

    # gather through every block-table format
    lengths = torch.tensor(lens, dtype=draw(INDEX, label="seq_lens dtype"))
    max_seq_len = draw(st.one_of(st.integers(0, 3 * B + 2), st.just(2**31 - 1)), label="max_seq_len")
    cut_lens = [min(n, max_seq_len) for n in lens]
    tables = {"PACKED": (BlockTable.packed(table), 1)}
    ind, ip = bt.packed_to_ragged(table, lengths, B)
    tables["RAGGED"] = (BlockTable.ragged(ind, ip, table.shape[1]), 1)
    if bt.is_power_of_two(B):
        beam = draw(st.integers(1, 3), label="beam_width")
        tables["KV_OFFSETS"] = (BlockTable.kv_offsets(bt.packed_to_kv_offsets(table, beam_width=beam)), beam)
    event(f"max_seq_len cuts a sequence: {any(c < n for c, n in zip(cut_lens, lens, strict=True))}")
    for name, (blocks, beam) in tables.items():
        event(f"format {name} beam {beam}")
        c = cache
        if name == "KV_OFFSETS":
            c = dataclasses.replace(cache, pool=PoolDesc(memory_of(k), k[0].numel() * k.element_size(), k))
        g = GatherDesc(blocks, SeqLens(lengths), max_seq_len)
        want_lens = [n for n in cut_lens for _ in range(beam)]
        assert g.output_lengths().tolist() == want_lens
        want_k = torch.cat([keys[s][:n].to(cache_dtype) for s, n in enumerate(cut_lens) for _ in range(beam)]
                           + [torch.zeros(0, H, D, dtype=cache_dtype)])
        want_v = torch.cat([values[s][:n].to(cache_dtype) for s, n in enumerate(cut_lens) for _ in range(beam)]
                           + [torch.zeros(0, H, D, dtype=cache_dtype)])
        out = gather_kv(c, g)
        assert out.key.dtype == cache_dtype and out.key.shape == (sum(want_lens), H, D), name
        assert torch.equal(out.key, want_k), name
        assert torch.equal(out.value, want_v), name
        # caller-provided output of another IO dtype with spare rows: rows past the total untouched
        spare = draw(st.integers(0, 2), label="spare rows")
        od = draw(st.sampled_from(DTYPES), label="out dtype")
        fill = torch.full((sum(want_lens) + spare, H, D), 5.0, dtype=od)
        res = gather_kv(c, g, KvIoDesc(fill.clone(), fill.clone()))
        assert torch.equal(res.key[:sum(want_lens)], want_k.to(od)), name
        assert torch.equal(res.value[:sum(want_lens)], want_v.to(od)), name
        assert bool((res.key[sum(want_lens):] == 5).all()) and bool((res.value[sum(want_lens):] == 5).all())


# ----------------------------------------------------------------------------- KV_OFFSETS: planes, beams, pools
@SETTINGS
@given(data=st.data(),
       block_size=st.sampled_from([1, 2, 4, 8]),
       heads=st.integers(1, 3),
       head_dim=st.sampled_from([1, 2, 4, 8]),
       dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_kv_offsets_distinct_planes_beams_and_secondary_pool(data, block_size, heads, head_dim, dtype, seed):
    """Each (sequence, beam) has its own K and V block lists; each block may live in the secondary
    pool (KVCacheIndex bit 31, read from pool.secondary). Entries past a sequence are null."""
    draw = data.draw
    gen = torch.Generator().manual_seed(seed)
    B, H, D = block_size, heads, head_dim
    lens = draw(st.lists(st.integers(0, 3 * B), min_size=1, max_size=3), label="lens")
    beam = draw(st.integers(1, 3), label="beam_width")
    need = [cdiv(n, B) for n in lens]
    m = max(need) + draw(st.integers(0, 1))
    S = len(lens)
    sec_p = draw(st.sampled_from([0.0, 0.5, 1.0]), label="secondary fraction")
    secondary = torch.rand(S, beam, m, generator=gen) < sec_p
    for s in range(S):
        secondary[s, :, need[s]:] = False
    n_sec_k = int(secondary.sum())  # secondary entries of the K plane; the V plane has as many
    n_prim = max(1, int((~secondary).sum()) - sum(m - k for k in need) * beam + draw(st.integers(0, 2)))
    n_sec = 2 * n_sec_k + draw(st.integers(0, 2))
    prim_k, prim_v = torch.randperm(n_prim, generator=gen), torch.randperm(n_prim, generator=gen)
    sec_ids = torch.randperm(max(n_sec, 1), generator=gen)
    k_table = torch.full((S, beam, m), -1, dtype=torch.int64)
    v_table = torch.full((S, beam, m), -1, dtype=torch.int64)
    ip = iv = isec = 0
    for s in range(S):
        for w in range(beam):
            for j in range(need[s]):
                if secondary[s, w, j]:
                    k_table[s, w, j], v_table[s, w, j] = sec_ids[isec], sec_ids[isec + 1]
                    isec += 2
                else:
                    k_table[s, w, j], v_table[s, w, j] = prim_k[ip], prim_v[iv]
                    ip, iv = ip + 1, iv + 1
    spec = draw(tensor_layouts(D), label="layout")
    layout, pack = spec[0], spec[1]
    v_spec = draw(tensor_layouts(D, layout), label="V strides")
    v_spec = (layout, pack) + v_spec[2:]
    s_spec = (layout, pack) + draw(tensor_layouts(D, layout), label="secondary strides")[2:]
    k = make_cache_tensor(torch.randn(n_prim, B, H, D, generator=gen).to(dtype), spec)
    v = make_cache_tensor(torch.randn(n_prim, B, H, D, generator=gen).to(dtype), v_spec)
    sec = make_cache_tensor(torch.randn(max(n_sec, 1), B, H, D, generator=gen).to(dtype), s_spec)

    def write_plane(dst: torch.Tensor, as_k: bool, n_blocks: int, slots, toks):
        """write_kv into one tensor only: the other side of the cache is a scratch tensor."""
        scratch = torch.zeros(n_blocks, B, H, D, dtype=dtype)
        kk, vv = (dst, scratch) if as_k else (scratch, dst)
        c = CacheDesc.from_torch(kk, vv, block_size=B, num_kv_heads=H, head_dim=D,
                                 k_layout=layout if as_k else Layout.NHD, v_layout=Layout.NHD if as_k else layout)
        write_kv(c, WriteDesc(KvIoDesc(toks, toks), SlotMapping(torch.tensor(slots, dtype=torch.int64))))

    keys = [[torch.randn(n, H, D, generator=gen) for _ in range(beam)] for n in lens]
    values = [[torch.randn(n, H, D, generator=gen) for _ in range(beam)] for n in lens]
    groups = {}  # (tensor name) -> (slots, tokens)
    for s, n in enumerate(lens):
        for w in range(beam):
            for p in range(n):
                j = p // B
                for plane, ids, toks in (("k", k_table, keys), ("v", v_table, values)):
                    where = "sec_" + plane if secondary[s, w, j] else plane
                    groups.setdefault(where, ([], []))
                    groups[where][0].append(int(ids[s, w, j]) * B + p % B)
                    groups[where][1].append(toks[s][w][p])
    for where, (slots, toks) in groups.items():
        dst, n_blocks = {"k": (k, n_prim), "v": (v, n_prim), "sec_k": (sec, n_sec), "sec_v": (sec, n_sec)}[where]
        write_plane(dst, where.endswith("k"), max(n_blocks, 1), slots, torch.stack(toks))

    offsets = torch.cat([bt.packed_to_kv_offsets(k_table[:, w], v_table[:, w], 1, secondary[:, w])
                         for w in range(beam)], dim=1)
    assert offsets.shape == (S, beam, 2, m) and offsets.dtype == torch.int32
    # the table holds exactly the TRT-LLM KVCacheIndex of each entry
    for s in range(S):
        for w in range(beam):
            for j in range(m):
                for plane, ids in ((0, k_table), (1, v_table)):
                    i = int(ids[s, w, j])
                    want = -1 if i < 0 else (i - 2**31 if secondary[s, w, j] else i)
                    assert int(offsets[s, w, plane, j]) == want
    pool = PoolDesc(memory_of(k), k[0].numel() * k.element_size(), k, sec if n_sec else None)
    event(f"secondary pool used: {n_sec_k > 0}")
    event(f"beam {beam}, layout {layout.name}")
    cache = CacheDesc.from_torch(k, v, block_size=B, num_kv_heads=H, head_dim=D, k_layout=layout, v_layout=layout,
                                 pool=pool)
    max_seq_len = draw(st.integers(0, 3 * B + 1), label="max_seq_len")
    g = GatherDesc(BlockTable.kv_offsets(offsets), SeqLens(torch.tensor(lens, dtype=torch.int32)), max_seq_len)
    out = gather_kv(cache, g)
    cut = [min(n, max_seq_len) for n in lens]
    want_k = torch.cat([keys[s][w][:cut[s]] for s in range(S) for w in range(beam)]).to(dtype)
    want_v = torch.cat([values[s][w][:cut[s]] for s in range(S) for w in range(beam)]).to(dtype)
    assert torch.equal(out.key, want_k)
    assert torch.equal(out.value, want_v)


# ----------------------------------------------------------------------------- encodings
@st.composite
def packed_tables(draw, min_block=1):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 16]))
    lens = draw(st.lists(st.integers(0, 4 * block_size), max_size=5))
    m = max([cdiv(n, block_size) for n in lens], default=0) + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(INDEX)
    table = torch.randint(0, 1000, (len(lens), m), generator=torch.Generator().manual_seed(seed)).to(dtype)
    return table, torch.tensor(lens, dtype=draw(INDEX)), block_size


@SETTINGS
@given(packed_tables())
def test_packed_ragged_round_trip(args):
    table, lens, B = args
    indices, indptr = bt.packed_to_ragged(table, lens, B)
    assert indices.dtype == table.dtype and indptr.dtype == table.dtype
    # by hand: one entry per token, its sequence's block for that position
    want = [int(table[s, p // B]) for s, n in enumerate(lens.tolist()) for p in range(n)]
    assert indices.tolist() == want
    assert indptr.tolist() == [sum(lens.tolist()[:i]) for i in range(len(lens) + 1)]
    BlockTable.ragged(indices, indptr, table.shape[1]).validate()
    back, back_lens = bt.ragged_to_packed(indices, indptr, B, table.shape[1], pad=-1)
    assert back.shape == table.shape and back_lens.tolist() == lens.tolist()
    for s, n in enumerate(lens.tolist()):
        k = cdiv(n, B)
        assert torch.equal(back[s, :k], table[s, :k])
        assert bool((back[s, k:] == -1).all())
    tight, _ = bt.ragged_to_packed(indices, indptr, B)  # default width: the most blocks any sequence needs
    assert tight.shape[1] == max([cdiv(n, B) for n in lens.tolist()], default=0)


@SETTINGS
@given(packed_tables())
def test_packed_flashinfer_round_trip_and_hand_computation(args):
    table, lens, B = args
    indptr, indices, last = bt.packed_to_flashinfer(table, lens, B)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    pages = [cdiv(n, B) for n in lens.tolist()]
    assert indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
    assert indices.tolist() == [int(table[s, j]) for s in range(len(pages)) for j in range(pages[s])]
    assert last.tolist() == [n - (p - 1) * B if p else 0 for n, p in zip(lens.tolist(), pages, strict=True)]
    assert all(1 <= x <= B for x, p in zip(last.tolist(), pages, strict=True) if p)
    back, back_lens = bt.flashinfer_to_packed(indptr, indices, last, B, pad=-1)
    assert back_lens.tolist() == lens.tolist()
    for s, p in enumerate(pages):
        assert back[s, :p].tolist() == table[s, :p].tolist()
        assert bool((back[s, p:] == -1).all())


def test_flashinfer_hand_example():
    table = torch.tensor([[7, 3, 9], [4, 0, 0], [1, 2, 5], [6, 6, 6]])
    lens = torch.tensor([9, 4, 0, 1])  # block_size 4: 3 pages (last 1), 1 page (last 4), none, 1 page (last 1)
    indptr, indices, last = bt.packed_to_flashinfer(table, lens, 4)
    assert indptr.tolist() == [0, 3, 4, 4, 5]
    assert indices.tolist() == [7, 3, 9, 4, 6]
    assert last.tolist() == [1, 4, 0, 1]


@SETTINGS
@given(st.lists(st.tuples(st.one_of(st.integers(0, 2**31 - 2), st.just(-1), st.sampled_from([0, 1, 2**31 - 2])),
                          st.booleans()), max_size=20),
       st.integers(0, 2**31 - 1))
def test_kv_cache_index_encode_decode(entries, extra):
    idx = torch.tensor([i for i, _ in entries] + [extra], dtype=torch.int64)
    sec = torch.tensor([s for _, s in entries] + [False])
    enc = bt.make_kv_cache_index(idx, sec)
    assert enc.dtype == torch.int32
    for i, s, e in zip(idx.tolist(), sec.tolist(), enc.tolist(), strict=True):
        if i == -1:
            assert e == KVCACHEINDEX_NULL
        elif s:
            assert e == i - 2**31 and (e + 2**32) & KVCACHEINDEX_SECONDARY_BIT  # bit 31 set
        else:
            assert e == i
    index, is_sec, is_null = bt.split_kv_cache_index(enc)
    assert index.tolist() == idx.tolist()
    assert is_null.tolist() == [i == -1 for i in idx.tolist()]
    assert is_sec.tolist() == [s and i != -1 for i, s in zip(idx.tolist(), sec.tolist(), strict=True)]
    # the decoder also accepts int64 views of the same bits
    index2, is_sec2, _ = bt.split_kv_cache_index(enc.to(torch.int64) & 0xFFFFFFFF)
    assert index2.tolist() == idx.tolist() and is_sec2.tolist() == is_sec.tolist()


def test_kv_cache_index_known_values():
    enc = bt.make_kv_cache_index(torch.tensor([0, 5, 2**31 - 2, -1, 2**31 - 1, 0]),
                                 torch.tensor([True, True, True, True, False, False]))
    assert enc.tolist() == [-(2**31), -(2**31) + 5, -2, -1, 2**31 - 1, 0]
    assert bt.make_kv_cache_index(torch.tensor([3]), True).tolist() == [-(2**31) + 3]  # scalar flag
    idx, sec, null = bt.split_kv_cache_index(torch.tensor([-1, -2, -(2**31), 2**31 - 1], dtype=torch.int32))
    assert idx.tolist() == [-1, 2**31 - 2, 0, 2**31 - 1]
    assert sec.tolist() == [False, True, True, False] and null.tolist() == [True, False, False, False]


@SETTINGS
@given(data=st.data(), packed=packed_tables(), beam=st.integers(1, 3))
def test_packed_kv_offsets_round_trip(data, packed, beam):
    table, lens, B = packed
    v_table = (table + 1) % 1000
    sec = torch.tensor(data.draw(st.lists(st.booleans(), min_size=table.numel(), max_size=table.numel())),
                       dtype=torch.bool).reshape(table.shape)
    off = bt.packed_to_kv_offsets(table, v_table, beam, sec)
    assert off.shape == (table.shape[0], beam, 2, table.shape[1]) and off.is_contiguous()
    for w in range(beam):
        for plane, want in ((0, table), (1, v_table)):
            idx, is_sec = bt.kv_offsets_to_packed(off, w, plane)
            assert idx.tolist() == want.tolist() and is_sec.tolist() == sec.tolist()
    same = bt.packed_to_kv_offsets(table)  # V plane defaults to the K table
    assert torch.equal(same[:, :, 0], same[:, :, 1])


@SETTINGS
@given(packed=packed_tables(), data=st.data())
def test_slot_mapping_matches_hand_formula(packed, data):
    table, lens, B = packed
    S, M = table.shape
    n = data.draw(st.integers(0, 12))
    seq_ids = torch.tensor(data.draw(st.lists(st.integers(-1, S - 1) if S else st.just(-1), min_size=n, max_size=n)),
                           dtype=torch.int64)
    positions = torch.tensor(data.draw(st.lists(st.integers(-2, max(M * B - 1, 0)), min_size=n, max_size=n)),
                             dtype=torch.int64)
    if M == 0:
        positions = torch.full_like(positions, -1)
    invalid = data.draw(st.sampled_from([-1, -99, 10**9]))
    got = bt.slot_mapping(table, seq_ids, positions, B, invalid)
    assert got.dtype == torch.int64
    assert got.tolist() == slots_by_hand(table, seq_ids, positions, B, invalid).tolist()
    # spec §4.1: slot -> (block_idx, block_offset)
    for slot, s, p in zip(got.tolist(), seq_ids.tolist(), positions.tolist(), strict=True):
        if s >= 0 and p >= 0:
            assert (slot // B, slot % B) == (int(table[s, p // B]), p % B)


def test_max_seq_len_truncation_every_format():
    B, H, D = 4, 1, 2
    k = torch.zeros(4, B, H, D)
    cache = CacheDesc.from_torch(k, k.clone(), block_size=B, num_kv_heads=H, head_dim=D,
                                 pool=PoolDesc(memory_of(k), 32, k))
    table = torch.tensor([[2, 0], [1, 3]])
    toks = torch.arange(16, dtype=torch.float32).reshape(16, 1, 1).expand(16, H, D)
    slots = torch.cat([torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])])
    write_kv(cache, WriteDesc(KvIoDesc(toks, toks + 100), SlotMapping(slots)))
    lens = torch.tensor([7, 5])
    ind, ip = bt.packed_to_ragged(table, lens, B)
    for blocks in (BlockTable.packed(table), BlockTable.ragged(ind, ip, 2),
                   BlockTable.kv_offsets(bt.packed_to_kv_offsets(table))):
        for max_len, want in ((0, []), (1, [0, 8]), (3, [0, 1, 2, 8, 9, 10]),
                              (6, [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12]),
                              (100, [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12])):
            out = gather_kv(cache, GatherDesc(blocks, SeqLens(lens), max_len))
            assert out.key[:, 0, 0].tolist() == want, (blocks.format, max_len)
            assert (out.value[:, 0, 0] - 100).tolist() == want


def test_zero_sequences_and_zero_lengths():
    k = torch.randn(2, 4, 1, 2)
    cache = CacheDesc.from_torch(k, k.clone(), block_size=4, num_kv_heads=1, head_dim=2)
    for table, lens in ((torch.zeros(0, 3, dtype=torch.int32), []), (torch.full((3, 0), 5), [0, 0, 0])):
        out = gather_kv(cache, GatherDesc(BlockTable.packed(table), SeqLens(torch.tensor(lens, dtype=torch.int64)), 8))
        assert out.key.shape == (0, 1, 2) and out.value.shape == (0, 1, 2)
    write_kv(cache, WriteDesc(KvIoDesc(torch.zeros(0, 1, 2), torch.zeros(0, 1, 2)),
                              SlotMapping(torch.zeros(0, dtype=torch.int64))))


def test_packed_table_given_as_flat_buffer():
    """A PACKED table described like the C ABI does (flat indices + seq_count/max_blocks) gathers
    the same as the 2-D tensor."""
    k = torch.randn(4, 2, 1, 2)
    cache = CacheDesc.from_torch(k, k.clone(), block_size=2, num_kv_heads=1, head_dim=2)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    g2 = GatherDesc(BlockTable.packed(table), SeqLens(torch.tensor([3, 4])), 10)
    flat = BlockTable(g2.block_table.format, table.flatten(), 2, 2)
    flat.validate()
    a, b = gather_kv(cache, g2), gather_kv(cache, GatherDesc(flat, g2.seq_lens, 10))
    assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)
