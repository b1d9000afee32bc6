"""FlashInfer adapters: `append_paged_kv_cache` semantics against KVX gather / write, page tables."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvx_adapters import flashinfer
from kvx_core.block_tables import packed_to_ragged
from kvx_core.descriptors import BlockTable, CacheDesc, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat, Layout
from kvx_core.errors import KvxError, Status
from kvx_core.ops.reference import gather_kv, write_kv

from .engine_ref import DTYPES, flashinfer_append, flashinfer_read, make_workload, same_view

SETTINGS = settings(max_examples=25, deadline=None)

geometry = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 37), min_size=1, max_size=4),
    "page_size": st.sampled_from([1, 2, 4, 8, 16]),
    "heads": st.integers(1, 3),
    "head_dim": st.sampled_from([8, 16, 32]),
    "dtype": st.sampled_from(DTYPES),
    "seed": st.integers(0, 2**31 - 1),
})


def _allocate(form: str, kv_layout: str, n: int, ps: int, h: int, d: int, dtype: torch.dtype, squeeze: bool):
    """The paged_kv_cache argument of `append_paged_kv_cache` and its (k_cache, v_cache) 4-D views."""
    inner = (ps, h, d) if kv_layout == "NHD" else (h, ps, d)
    if form == "stacked":
        t = torch.zeros((n, 2) + inner, dtype=dtype)
        k4, v4 = t[:, 0], t[:, 1]
        arg = t.squeeze(2 if kv_layout == "NHD" else 3) if squeeze else t  # page_size 1: 4-D (utils._expand_5d)
    else:
        k4, v4 = torch.zeros((n,) + inner, dtype=dtype), torch.zeros((n,) + inner, dtype=dtype)
        sq = 1 if kv_layout == "NHD" else 2
        arg = (k4.squeeze(sq), v4.squeeze(sq)) if squeeze else (k4, v4)
    return arg, k4, v4


def _page_table(wl):
    indptr, indices, last = [0], [], []
    for s, n in enumerate(wl.lens):
        pages = (n + wl.block_size - 1) // wl.block_size
        indices += wl.table[s, :pages].tolist()
        indptr.append(indptr[-1] + pages)
        last.append(0 if pages == 0 else n - (pages - 1) * wl.block_size)
    i32 = torch.int32
    return torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32)


@SETTINGS
@given(g=geometry, kv_layout=st.sampled_from(flashinfer.KV_LAYOUTS), form=st.sampled_from(["stacked", "tuple"]))
def test_append_then_kvx_gather(g, kv_layout, form):
    gen = torch.Generator().manual_seed(g["seed"])
    ps, h, d = g["page_size"], g["heads"], g["head_dim"]
    wl = make_workload(gen, g["lens"], ps, h, d, g["dtype"])
    squeeze = ps == 1 and g["seed"] % 2 == 0
    arg, k4, v4 = _allocate(form, kv_layout, wl.num_blocks, ps, h, d, g["dtype"], squeeze)
    indptr, indices, last = _page_table(wl)
    ok = wl.seq_ids >= 0
    flashinfer_append(wl.key[ok], wl.value[ok], k4, v4, kv_layout, wl.seq_ids[ok], wl.positions[ok], indptr, indices)

    cache = flashinfer.from_flashinfer_paged_kv_cache(arg, kv_layout, num_kv_heads=h, head_dim=d, page_size=ps)
    if h > 1 and ps > 1:
        assert cache.k.layout == Layout[kv_layout]
    assert cache.k.tensor.data_ptr() == k4.data_ptr() and cache.v.tensor.data_ptr() == v4.data_ptr()
    table, seq = flashinfer.from_flashinfer_page_table(indptr, indices, last, ps)
    assert seq.lengths.tolist() == wl.lens and table.format == BlockTableFormat.PACKED
    out = gather_kv(cache, GatherDesc(table, seq, max(wl.lens)))
    ek, ev = wl.expected()
    assert torch.equal(out.key, ek) and torch.equal(out.value, ev)

    ip2, idx2, last2 = flashinfer.to_flashinfer_page_table(table, seq, ps)
    assert torch.equal(ip2, indptr) and torch.equal(idx2, indices) and torch.equal(last2, last)


@SETTINGS
@given(g=geometry, kv_layout=st.sampled_from(flashinfer.KV_LAYOUTS), form=st.sampled_from(["stacked", "tuple"]))
def test_kvx_write_flashinfer_read_and_reverse(g, kv_layout, form):
    gen = torch.Generator().manual_seed(g["seed"])
    ps, h, d = g["page_size"], g["heads"], g["head_dim"]
    wl = make_workload(gen, g["lens"], ps, h, d, g["dtype"])
    arg, k4, v4 = _allocate(form, kv_layout, wl.num_blocks, ps, h, d, g["dtype"], False)
    cache = flashinfer.from_flashinfer_paged_kv_cache(arg, kv_layout)
    write_kv(cache, WriteDesc(KvIoDesc(wl.key, wl.value), SlotMapping(wl.slots)))
    indptr, indices, _ = _page_table(wl)
    ok = wl.seq_ids >= 0
    k, v = flashinfer_read(k4, v4, kv_layout, wl.seq_ids[ok], wl.positions[ok], indptr, indices)
    assert torch.equal(k, wl.key[ok]) and torch.equal(v, wl.value[ok])

    k2, v2 = flashinfer.to_flashinfer_paged_kv_cache(cache, kv_layout)
    assert same_view(k2, k4) and same_view(v2, v4)
    if form == "stacked":
        assert same_view(flashinfer.to_flashinfer_paged_kv_cache(cache, kv_layout, stacked=True), arg)
    else:
        with pytest.raises(KvxError) as e:
            flashinfer.to_flashinfer_paged_kv_cache(cache, kv_layout, stacked=True)
        assert e.value.status == Status.UNSUPPORTED


def test_nhd_indexed_tensor_with_hnd_memory():
    """An NHD-indexed view whose memory is HND (a permuted allocation) is described as HND."""
    mem = torch.zeros(5, 2, 3, 4, 8)  # [pages, 2, H, page_size, D] in memory
    nhd_view = mem.permute(0, 1, 3, 2, 4)
    cache = flashinfer.from_flashinfer_paged_kv_cache(nhd_view, "NHD")
    assert cache.k.layout == Layout.HND and cache.v.layout == Layout.HND
    write_kv(cache, WriteDesc(KvIoDesc(torch.ones(1, 3, 8), torch.ones(1, 3, 8)),
                              SlotMapping(torch.tensor([4 * 2 + 1]))))
    assert mem[2, 0, :, 1].eq(1).all() and mem.sum() == 2 * 3 * 8


def test_page_table_from_ragged_and_zero_length():
    table = torch.tensor([[4, 1, 0], [2, 2, 2], [3, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 0, 9])
    ip, idx, last = flashinfer.to_flashinfer_page_table(BlockTable.packed(table), SeqLens(lens), 4)
    assert ip.tolist() == [0, 2, 2, 5] and idx.tolist() == [4, 1, 3, 5, 6] and last.tolist() == [1, 0, 1]
    r, rip = packed_to_ragged(table, lens, 4)
    ip2, idx2, last2 = flashinfer.to_flashinfer_page_table(BlockTable.ragged(r, rip, 3), SeqLens(lens), 4,
                                                           block_size=4)
    assert torch.equal(ip, ip2) and torch.equal(idx, idx2) and torch.equal(last, last2)
    t2, s2 = flashinfer.from_flashinfer_page_table(ip, torch.cat([idx, torch.tensor([9, 9], dtype=torch.int32)]),
                                                   last, 4)  # trailing capacity in indices is ignored
    assert s2.lengths.tolist() == [5, 0, 9] and t2.indices[2].tolist() == [3, 5, 6]


@pytest.mark.parametrize("bad", [
    lambda: flashinfer.from_flashinfer_paged_kv_cache(torch.zeros(4, 3, 16, 2, 8)),
    lambda: flashinfer.from_flashinfer_paged_kv_cache(torch.zeros(4, 2, 16, 2, 8), "HDN"),
    lambda: flashinfer.from_flashinfer_paged_kv_cache((torch.zeros(4, 16, 2, 8),)),
    lambda: flashinfer.from_flashinfer_paged_kv_cache((torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 4))),
    lambda: flashinfer.from_flashinfer_paged_kv_cache(torch.zeros(4, 2, 16, 2, 8), page_size=8),
    lambda: flashinfer.from_flashinfer_page_table(torch.tensor([0, 2]), torch.tensor([1, 2]), torch.tensor([5]), 4),
    lambda: flashinfer.from_flashinfer_page_table(torch.tensor([0, 3]), torch.tensor([1, 2]), torch.tensor([1]), 4),
    lambda: flashinfer.from_flashinfer_page_table(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([1]), 4),
    lambda: flashinfer.from_flashinfer_page_table(torch.tensor([0, 1, 2]), torch.tensor([1, 2]), torch.tensor([1]), 4),
    lambda: flashinfer.to_flashinfer_page_table(BlockTable.packed(torch.zeros(2, 2, dtype=torch.int32)),
                                                SeqLens(torch.tensor([1])), 4),
])
def test_bad_input_is_a_kvx_error(bad):
    with pytest.raises(KvxError) as e:
        bad()
    assert e.value.status == Status.INVALID_ARGUMENT


def test_reverse_needs_contiguous_head_dim():
    big = torch.zeros(4, 16, 2, 16)
    cache = CacheDesc.from_torch(big[..., ::2], big[..., 1::2], block_size=16, num_kv_heads=2, head_dim=8)
    with pytest.raises(KvxError) as e:
        flashinfer.to_flashinfer_paged_kv_cache(cache)
    assert e.value.status == Status.UNSUPPORTED
