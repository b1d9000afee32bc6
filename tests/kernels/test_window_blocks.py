"""Sliding windows over paged caches whose rows hold stale or null block ids before the window (vLLM's
sliding-window manager frees those blocks and leaves their ids, or the null block's, in the table): the reference
(the CPU path) and the Triton kernels (forced on CPU under the interpreter, natural on CUDA) never read a block that
lies wholly before the first key a query's window sees. Here those ids point at a block of NaN K/V: any read of
it shows as NaN. Also the `queries_after` prefill (a chunk's queries right after the cached tokens: vLLM's split
prefill of a window layer) against an FP64 oracle (`oracle.windowed`).
"""
from __future__ import annotations

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch, reference

from .oracle import windowed

BS, HKV, QH, D = 4, 2, 2, 64
WINDOW = 6
LENS = [23, 9, 1, 30]
Q_LENS = [5, 9, 1, 3]


def _cache(name: str, device: str):
    """(cache, honest table [B, M], poison block id): every table block holds random tokens, the poison block NaN."""
    need = [(n + BS - 1) // BS for n in LENS]
    nb = sum(need) + 1
    poison = nb - 1
    c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=BS, num_kv_heads=HKV, head_dim=D, device=device)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(nb * BS, HKV, D, generator=g)
    v = torch.randn(nb * BS, HKV, D, generator=g)
    k[poison * BS:] = float("nan")
    v[poison * BS:] = float("nan")
    reference.write_kv(c.descriptor(0), WriteDesc(KvIoDesc(k.to(device), v.to(device)),
                                                  SlotMapping(torch.arange(nb * BS).to(device))))
    bt = torch.zeros(len(LENS), max(need), dtype=torch.int32)
    perm, i = torch.randperm(nb - 1, generator=g), 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n]
        i += n
    return c, bt, poison


def _poisoned(bt: torch.Tensor, first_keys: list[int], poison: int) -> torch.Tensor:
    """The table with every block wholly before each row's first visible key replaced by the poison block."""
    out = bt.clone()
    for b, f in enumerate(first_keys):
        out[b, :max(f, 0) // BS] = poison
    return out


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4"])
def test_window_never_reads_blocks_before_it(name, kernels, device, monkeypatch):
    if kernels:
        monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c, bt, poison = _cache(name, device)
    desc = c.descriptor(0)
    assert reference.gather_kv(desc, GatherDesc(BlockTable.packed(torch.full((1, 1), poison, dtype=torch.int32)
                                                                    .to(device)), SeqLens(torch.tensor(
        [BS], dtype=torch.int32).to(device)), BS)).value.isnan().all(), "the poison block must decode to NaN"
    lens = SeqLens(torch.tensor(LENS, dtype=torch.int32).to(device))
    g = torch.Generator().manual_seed(3)
    geometry = dict(fmt=name, num_qo_heads=HKV * QH, num_kv_heads=HKV, head_dim=D, block_size=BS,
                    q_dtype=torch.bfloat16, device=device, window=WINDOW)

    q = torch.randn(len(LENS), HKV * QH, D, generator=g).bfloat16().to(device)
    decode_first = [n - 1 - WINDOW for n in LENS]
    qo = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    qp = torch.randn(sum(Q_LENS), HKV * QH, D, generator=g).bfloat16().to(device)
    prefill_first = [n - m - WINDOW for n, m in zip(LENS, Q_LENS, strict=True)]
    after_first = [n - WINDOW for n in LENS]
    steps = [
        (decode_first, lambda t: dispatch.plan_decode(t, lens, max_seq_len=max(LENS), **geometry).run(q, desc)),
        (prefill_first, lambda t: dispatch.plan_prefill(qo, t, lens, **geometry).run(qp, desc)),
        (after_first, lambda t: dispatch.plan_prefill(qo, t, lens, causal=False, queries_after=True,
                                                      **geometry).run(qp, desc)),
    ]
    for first, step in steps:
        honest = step(BlockTable.packed(bt.to(device)))
        got = step(BlockTable.packed(_poisoned(bt, first, poison).to(device)))
        assert any(f >= BS for f in first)  # some rows do have blocks before the window
        for a, b in zip(got, honest, strict=True):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("window", [None, 0, 5, 100])
def test_queries_after_matches_the_oracle(window, kernels, device, monkeypatch):
    """Each request's queries at positions seq_len .. seq_len + q_len - 1 over its cached tokens only (a fresh
    request with 0 cached tokens included): the oracle masks by those positions."""
    if kernels:
        monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c, bt, _ = _cache("int8", device)
    desc = c.descriptor(0)
    lens_list = [0, *LENS[1:]]
    lens = SeqLens(torch.tensor(lens_list, dtype=torch.int32).to(device))
    qo = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    qp = torch.randn(sum(Q_LENS), HKV * QH, D, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    out, _ = dispatch.plan_prefill(qo, BlockTable.packed(bt.to(device)), lens, fmt="int8", num_qo_heads=HKV * QH,
                                   num_kv_heads=HKV, head_dim=D, block_size=BS, q_dtype=torch.bfloat16, device=device,
                                   causal=False, queries_after=True, window=window).run(qp, desc)
    kv = reference.gather_kv(desc, GatherDesc(BlockTable.packed(bt.to(device)), lens, max(lens_list)))
    starts = [0, *torch.tensor(lens_list).cumsum(0).tolist()]
    for b, (n, m) in enumerate(zip(lens_list, Q_LENS, strict=True)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        want = windowed(qp[rows], kv.key[starts[b]:starts[b + 1]], kv.value[starts[b]:starts[b + 1]],
                        torch.arange(n, n + m), window, D ** -0.5)
        err = (out[rows].cpu().double() - want).norm() / max(float(want.norm()), 1e-30)
        assert err < 1e-2 or float(want.norm()) == 0 and float(out[rows].float().norm()) == 0, (b, float(err))


def test_queries_after_needs_causal_false(device):
    _, bt, _ = _cache("int8", device)
    lens = SeqLens(torch.tensor(LENS, dtype=torch.int32))
    qo = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    for bad in (dict(causal=True, queries_after=True), dict(causal=False, queries_after=1)):
        with pytest.raises(KvxError) as e:
            dispatch.plan_prefill(qo, BlockTable.packed(bt), lens, fmt="int8", num_qo_heads=HKV * QH,
                                  num_kv_heads=HKV, head_dim=D, block_size=BS, q_dtype=torch.bfloat16, device="cpu",
                                  **bad)
        assert e.value.status == Status.INVALID_ARGUMENT and "queries_after" in e.value.message
    with pytest.raises(KvxError) as e:
        attention.paged_prefill(torch.zeros(sum(Q_LENS), HKV * QH, D), qo, _cache("int8", "cpu")[0].descriptor(0),
                                BlockTable.packed(bt), lens, causal=True, queries_after=True)
    assert e.value.status == Status.INVALID_ARGUMENT
