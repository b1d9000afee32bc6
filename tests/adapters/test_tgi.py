"""TGI adapters: caches written by TGI's store paths read through KVX, and the reverse."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvx_adapters import tgi
from kvx_core.block_tables import packed_to_ragged
from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat, Layout
from kvx_core.errors import KvxError, Status
from kvx_core.ops.reference import gather_kv, write_kv

from .engine_ref import (
    DTYPES,
    make_workload,
    same_view,
    tgi_store_hnd,
    tgi_store_nhd,
    vllm_paged_read,
    vllm_reshape_and_cache,
)

SETTINGS = settings(max_examples=15, deadline=None)
# TGI models/globals.py BLOCK_SIZE per ATTENTION
BLOCK_SIZE = {"flashinfer": 1, "flashdecoding": 256, "flashdecoding-ipex": 64, "paged": 16, "ipex-cpu": 64}

geometry = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 40), min_size=1, max_size=4),
    "heads": st.integers(1, 3),
    "head_dim": st.sampled_from([8, 16, 32]),
    "dtype": st.sampled_from(DTYPES),
    "seed": st.integers(0, 2**31 - 1),
})


def _allocate(attention: str, n: int, h: int, d: int, dtype: torch.dtype):
    """`KVCache.__init__` shapes (layers/attention/kv_cache.py), x = BLOCK_SIZE // element_size."""
    bs = BLOCK_SIZE[attention]
    if attention == "paged":
        x = bs // torch.empty((), dtype=dtype).element_size()
        return torch.zeros(n, h, d // x, bs, x, dtype=dtype), torch.zeros(n, h, d, bs, dtype=dtype)
    shape = (n, h, bs, d) if attention == "ipex-cpu" else (n, bs, h, d)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _store(attention, wl, k, v):
    ok = wl.slots >= 0  # TGI never pads with -1: keep only real tokens for its store
    if attention == "paged":
        vllm_reshape_and_cache(wl.key[ok], wl.value[ok], k, v, wl.slots[ok])
    elif attention == "ipex-cpu":
        tgi_store_hnd(wl.key[ok], wl.value[ok], k, v, wl.slots[ok])
    else:
        tgi_store_nhd(wl.key[ok], wl.value[ok], k, v, wl.slots[ok])


def _read(attention, k, v, slots):
    if attention == "paged":
        return vllm_paged_read(k, v, slots)
    if attention == "ipex-cpu":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    b = k.shape[1]
    return k[slots // b, slots % b], v[slots // b, slots % b]


@SETTINGS
@given(g=geometry, attention=st.sampled_from(tgi.ATTENTION))
def test_engine_store_kvx_gather(g, attention):
    gen = torch.Generator().manual_seed(g["seed"])
    bs = BLOCK_SIZE[attention]
    wl = make_workload(gen, g["lens"], bs, g["heads"], g["head_dim"], g["dtype"])
    k, v = _allocate(attention, wl.num_blocks, g["heads"], g["head_dim"], g["dtype"])
    _store(attention, wl, k, v)

    cache = tgi.from_tgi_kv_cache((k, v), attention=attention, num_kv_heads=g["heads"], block_size=bs)
    want = {"paged": Layout.HND_PACKED, "ipex-cpu": Layout.HND}.get(attention, Layout.NHD)
    if g["heads"] > 1:
        assert cache.k.layout == want
    assert cache.k.tensor.data_ptr() == k.data_ptr() and cache.v.tensor.data_ptr() == v.data_ptr()
    table = tgi.block_tables_from_tgi(wl.table)
    seq = SeqLens(torch.tensor(wl.lens, dtype=torch.int32))
    out = gather_kv(cache, GatherDesc(table, seq, max(wl.lens)))
    ek, ev = wl.expected()
    assert torch.equal(out.key, ek) and torch.equal(out.value, ev)


@SETTINGS
@given(g=geometry, attention=st.sampled_from(tgi.ATTENTION))
def test_kvx_write_engine_read_and_reverse_views(g, attention):
    gen = torch.Generator().manual_seed(g["seed"])
    wl = make_workload(gen, g["lens"], BLOCK_SIZE[attention], g["heads"], g["head_dim"], g["dtype"])
    k, v = _allocate(attention, wl.num_blocks, g["heads"], g["head_dim"], g["dtype"])
    cache = tgi.from_tgi_kv_cache((k, v), attention=attention)
    write_kv(cache, WriteDesc(KvIoDesc(wl.key, wl.value), tgi.slots_from_tgi(wl.slots)))  # -1 padding: no-op
    ok = wl.slots >= 0
    rk, rv = _read(attention, k, v, wl.slots[ok])
    assert torch.equal(rk, wl.key[ok]) and torch.equal(rv, wl.value[ok])
    assert int((k != 0).sum()) == int((wl.key[ok] != 0).sum())  # nothing else was written

    k2, v2 = tgi.to_tgi_kv_cache(cache, attention=attention)
    assert same_view(k2, k) and same_view(v2, v)


@SETTINGS
@given(g=geometry)
def test_flashinfer_ragged_block_tables(g):
    """TGI flashinfer (BLOCK_SIZE 1): block_tables_ragged = first seq_len ids of each block-table row."""
    gen = torch.Generator().manual_seed(g["seed"])
    wl = make_workload(gen, g["lens"], 1, g["heads"], g["head_dim"], g["dtype"])
    k, v = _allocate("flashinfer", wl.num_blocks, g["heads"], g["head_dim"], g["dtype"])
    _store("flashinfer", wl, k, v)
    lens = torch.tensor(wl.lens, dtype=torch.int32)
    cache_lengths = torch.div(lens, 3, rounding_mode="floor")  # any split of seq_len into cached + new
    input_lengths = lens - cache_lengths
    # metadata_kernels.py block_tables_to_ragged (the non-Triton branch)
    ragged = torch.cat([wl.table[i, :n] for i, n in enumerate(wl.lens)]).to(torch.int32)

    table, seq = tgi.block_tables_ragged_from_tgi(ragged, input_lengths, cache_lengths)
    assert table.format == BlockTableFormat.RAGGED and table.indices.data_ptr() == ragged.data_ptr()
    assert seq.lengths.tolist() == wl.lens
    out = gather_kv(tgi.from_tgi_kv_cache((k, v), attention="flashinfer"), GatherDesc(table, seq, max(wl.lens)))
    ek, ev = wl.expected()
    assert torch.equal(out.key, ek) and torch.equal(out.value, ev)

    back, cu = tgi.block_tables_ragged_to_tgi(table, seq)
    assert back.data_ptr() == ragged.data_ptr() and cu.tolist()[-1] == sum(wl.lens)
    packed = BlockTable.packed(wl.table)
    back2, cu2 = tgi.block_tables_ragged_to_tgi(packed, SeqLens(lens))
    assert torch.equal(back2, ragged) and torch.equal(cu2, cu)


def test_ragged_needs_block_size_one():
    with pytest.raises(KvxError) as e:
        tgi.block_tables_ragged_from_tgi(torch.zeros(3, dtype=torch.int32), torch.tensor([3]), torch.tensor([0]),
                                         block_size=16)
    assert e.value.status == Status.INVALID_ARGUMENT and "BLOCK_SIZE of 1" in e.value.message
    with pytest.raises(KvxError):
        tgi.block_tables_ragged_from_tgi(torch.zeros(4, dtype=torch.int32), torch.tensor([3]), torch.tensor([0]))


def test_metadata():
    bt = torch.arange(12, dtype=torch.int32).view(3, 4)
    t = tgi.block_tables_from_tgi(bt)
    assert t.format == BlockTableFormat.PACKED and t.indices.data_ptr() == bt.data_ptr()
    assert tgi.block_tables_to_tgi(t).data_ptr() == bt.data_ptr()
    lens = torch.tensor([3, 0, 7])
    r, ip = packed_to_ragged(bt.to(torch.int64), lens, 2)
    assert torch.equal(tgi.block_tables_to_tgi(BlockTable.ragged(r, ip, 4), block_size=2)[2], bt[2])
    assert tgi.seq_lens_from_tgi(torch.tensor([1, 2], dtype=torch.int32),
                                 torch.tensor([4, 0], dtype=torch.int32)).lengths.tolist() == [5, 2]

    slots = torch.tensor([4, 9, 2], dtype=torch.int64)
    sm = tgi.slots_from_tgi(slots)
    assert sm.slots.data_ptr() == slots.data_ptr() and tgi.slots_to_tgi(sm).data_ptr() == slots.data_ptr()
    with pytest.raises(KvxError) as e:
        tgi.slots_to_tgi(SlotMapping(torch.tensor([4, -1])))
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [
    lambda: tgi.from_tgi_kv_cache(torch.zeros(4, 1, 2, 8), attention="flashinfer"),
    lambda: tgi.from_tgi_kv_cache((torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 2, 4)), attention="flashinfer"),
    lambda: tgi.from_tgi_kv_cache((torch.zeros(4, 1, 2, 8),) * 2, attention="sdpa"),
    lambda: tgi.from_tgi_kv_cache((torch.zeros(4, 1, 2, 8),) * 2, attention="flashdecoding", block_size=256),
    lambda: tgi.from_tgi_kv_cache((torch.zeros(4, 2, 8, 16), torch.zeros(4, 2, 8, 16)), attention="paged"),
    lambda: tgi.block_tables_from_tgi(torch.zeros(3, dtype=torch.int32)),
])
def test_bad_input_is_a_kvx_error(bad):
    with pytest.raises(KvxError) as e:
        bad()
    assert e.value.status == Status.INVALID_ARGUMENT


def test_reverse_refuses_non_contiguous():
    big = torch.zeros(4, 1, 2, 16)
    cache = tgi.from_tgi_kv_cache((big[..., :8], big[..., 8:]), attention="flashinfer")
    with pytest.raises(KvxError) as e:
        tgi.to_tgi_kv_cache(cache, attention="flashinfer")
    assert e.value.status == Status.UNSUPPORTED
