"""`kvx_vllm.prefill.SplitPrefill` (new tokens over their own K/V, cached prefix over KVX pages, merged by LSE)
against an FP64 oracle: `ops.attention.attend` over each request's dequantized prefix (the reference gather of
the pages) followed by its exact new K/V, causally at the new tokens' positions.

Ragged requests: an empty prefix (a fresh prompt: the prefix attention is empty, lse -inf), one new token over a
prefix (a decode token in a mixed batch), a long prefix with a long chunk. With attention sinks (gpt-oss) the
oracle joins them by their definition (`tests/kernels/oracle.with_sinks`): once per row, not once per piece.
CPU (vLLM CPU: the reference core for the new tokens, vLLM's torch merge) in CI; CUDA (vLLM's FlashAttention, the
KVX Triton prefill, vLLM's CUDA merge) on the GPU machine.
"""
from __future__ import annotations

import math

import pytest
import torch

CASES = {"mixed": ([0, 37, 300, 5], [20, 1, 64, 3]), "fresh": ([0, 0], [33, 7])}
TOLERANCE = 1e-2
"""Relative (Frobenius) error of the BF16 output: bf16 rounding of both partial outputs and of the result
(~2^-8 each), FlashAttention's bf16 P.V, and the prefix kernel's accumulation; a wrong mask, position or merge
weight gives errors of order 1."""


SINKS = [-1e4, 1e4, 0.0, 2.5, -3.0, 7.0, 0.5, -0.25]  # one per query head (2 KV heads x 4)


def _case(device: str, fmt: str, case: str, softcap: float | None, sinks: bool) -> dict:
    """A written cache of ragged requests, the step's queries and new K/V, and the FP64 oracle's output."""
    from kvx_core.cache import PagedKVCache
    from kvx_core.ops.attention import attend

    from ..kernels.oracle import with_sinks

    prefix_lens, q_lens = CASES[case]
    hkv, qh, d, bs = 2, 4, 64, 16
    g = torch.Generator().manual_seed(sum(prefix_lens) + len(fmt))
    totals = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    need = [math.ceil(t / bs) for t in totals]
    cache = PagedKVCache(fmt, num_layers=1, num_blocks=sum(need) + 1, block_size=bs, num_kv_heads=hkv, head_dim=d,
                         device=device)
    perm = torch.randperm(sum(need) + 1, generator=g)
    bt = torch.zeros(len(totals), max(need), dtype=torch.int32)
    slots, i = [], 0
    for b, (n, t) in enumerate(zip(need, totals, strict=True)):
        bt[b, :n] = perm[i:i + n]
        i += n
        slots.append(bt[b, torch.arange(t) // bs].long() * bs + torch.arange(t) % bs)
    k = torch.randn(sum(totals), hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(totals), hkv, d, generator=g).to(torch.bfloat16)
    k[..., :2] *= 4.0
    cache.write(0, k.to(device), v.to(device), torch.cat(slots).to(device))  # vLLM writes the new tokens first
    starts = torch.tensor([0, *totals[:-1]]).cumsum(0).tolist()  # each sequence's first row
    new = torch.cat([torch.arange(s + p, s + t) for s, p, t in zip(starts, prefix_lens, totals, strict=True)])
    q = torch.randn(sum(q_lens), hkv * qh, d, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    sk = torch.tensor(SINKS, device=device) if sinks else None

    kd, vd = cache.gather(0, bt.to(device), torch.tensor(prefix_lens, dtype=torch.int32, device=device))
    pstart = torch.tensor([0, *prefix_lens]).cumsum(0).tolist()
    ref = torch.empty(q.shape, dtype=torch.float64)
    for b, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kk = torch.cat([kd[pstart[b]:pstart[b + 1]].cpu().double(), k[new][rows].double()])
        vv = torch.cat([vd[pstart[b]:pstart[b + 1]].cpu().double(), v[new][rows].double()])
        o, lse = attend(q[rows], kk, vv, torch.arange(p, p + n), d ** -0.5, softcap, None, True)
        ref[rows] = with_sinks(o, lse, sk.cpu())[0] if sinks else o
    return dict(cache=cache, bt=bt.to(device), q=q.to(device), k=k[new].to(device), v=v[new].to(device),
                cu=cu, sk=sk, ref=ref, prefix_lens=prefix_lens, q_lens=q_lens, hkv=hkv, qh=qh, d=d, bs=bs)


def _compare(out: torch.Tensor, c: dict, what: str) -> None:
    got = out.cpu().double()
    assert not got.isnan().any()
    err = (got - c["ref"]).norm() / c["ref"].norm()
    assert err < TOLERANCE, f"{what}: relative error {err:.3g}"


def _check(device: str, fmt: str, case: str, softcap: float | None = None, sinks: bool = False) -> None:
    from kvx_core.descriptors import BlockTable, SeqLens
    from kvx_core.ops.dispatch import plan_prefill
    from kvx_vllm.prefill import SplitPrefill

    c = _case(device, fmt, case, softcap, sinks)
    plan = plan_prefill(c["cu"], BlockTable.packed(c["bt"]), SeqLens(torch.tensor(c["prefix_lens"], dtype=torch.int32,
                        device=device)), fmt=fmt, num_qo_heads=c["hkv"] * c["qh"], num_kv_heads=c["hkv"],
                        head_dim=c["d"], block_size=c["bs"], q_dtype=torch.bfloat16, device=device, causal=False,
                        softcap=softcap, check=False)
    out = torch.full(c["q"].shape, float("nan"), dtype=c["q"].dtype, device=device)
    SplitPrefill(plan, c["cu"].to(device), c["cu"].tolist(), max(c["q_lens"]), c["d"] ** -0.5, softcap).run(
        c["q"], c["k"], c["v"], c["cache"].descriptor(0), out, sinks=c["sk"])
    _compare(out, c, f"{fmt} {case}")


def _check_dense(device: str, fmt: str, case: str, min_query: int, capacity: int, monkeypatch,
                 sinks: bool = False) -> tuple[list[bool], bool]:
    """The metadata builder's split prefill (`KvxMetadataBuilder._split_prefill`, what vLLM's steps run) with a dense
    buffer of `capacity` tokens and `DENSE_MIN_QUERY = min_query`, run and compared with the oracle; returns (the
    requests it served dense, whether the fused prefix plan ran too)."""
    from types import SimpleNamespace

    from kvx_core.descriptors import BlockTable
    from kvx_core.formats import get_format
    from kvx_core.ops.dispatch import bind
    from kvx_vllm import prefill
    from kvx_vllm.backend import KvxMetadataBuilder

    monkeypatch.setattr(prefill, "DENSE_MIN_QUERY", min_query)
    c = _case(device, fmt, case, None, sinks)
    n, dev = len(c["q_lens"]), torch.device(device)
    lens = torch.tensor([p + q for p, q in zip(c["prefix_lens"], c["q_lens"], strict=True)], dtype=torch.int32)
    m = SimpleNamespace(num_reqs=n, num_actual_tokens=int(c["cu"][-1]), query_start_loc=c["cu"].to(dev),
                        query_start_loc_cpu=c["cu"], seq_lens=lens.to(dev), seq_lens_cpu_upper_bound=lens,
                        max_seq_len=int(lens.max()), max_query_len=max(c["q_lens"]))
    shape = (capacity, c["hkv"], c["d"])
    builder = SimpleNamespace(dense_kv=(torch.empty(shape, dtype=torch.bfloat16, device=dev),
                                        torch.empty(shape, dtype=torch.bfloat16, device=dev)),
                              sm_scale=None, softcap=None, window=None, kv_cache_spec=SimpleNamespace(head_size=c["d"]))
    for name in ("_prefix_bounds", "_dense_prefix"):
        setattr(builder, name, getattr(KvxMetadataBuilder, name).__get__(builder))
    geometry = dict(fmt=get_format(fmt), num_qo_heads=c["hkv"] * c["qh"], num_kv_heads=c["hkv"], head_dim=c["d"],
                    block_size=c["bs"], q_dtype=torch.bfloat16, device=dev, sm_scale=None, softcap=None,
                    window=None, check=False)
    plan = KvxMetadataBuilder._split_prefill(builder, m, BlockTable.packed(c["bt"]), geometry)
    out = torch.full(c["q"].shape, float("nan"), dtype=c["q"].dtype, device=device)
    desc = c["cache"].descriptor(0)
    plan.run(c["q"], c["k"], c["v"], desc, out, sinks=c["sk"], bound=bind(desc) or desc)
    _compare(out, c, f"{fmt} {case} dense (min query {min_query}, capacity {capacity})")
    dense = [] if plan.dense is None else (plan.dense.lens > 0).tolist()
    return dense, plan.prefix is not None


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "k8v4_rot"])
def test_split_prefill_matches_the_oracle_cpu(fmt, case):
    _check("cpu", fmt, case, softcap=30.0 if fmt == "int8" else None)


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "k8v4_rot"])
def test_split_prefill_counts_the_sinks_once_cpu(fmt, case):
    _check("cpu", fmt, case, softcap=30.0 if fmt == "int8" else None, sinks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "int4", "mxfp4", "k8v4_rot"])
def test_split_prefill_matches_the_oracle_cuda(fmt, case, sinks):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU with vLLM 0.26 (the GPU machine)")
    _check("cuda", fmt, case, softcap=30.0 if fmt == "int8" else None, sinks=sinks)


DENSE_CASES = [  # (min query, capacity) -> (requests served dense, fused plan too) for CASES["mixed"]
    ((16, 1024), ([False, False, True, False], True)),   # the 64-query request dense, the 1- and 3-query ones fused
    ((1, 1024), ([False, True, True, True], False)),     # every prefix dense: no fused plan
    ((1, 320), ([False, True, False, True], True)),      # 37 + 300 > 320: the 300-token prefix stays fused
    ((16, 100), ([], True)),                             # nothing fits: the fused route alone
]


@pytest.mark.vllm
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("route, want", DENSE_CASES)
@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_dense_prefixes_match_the_oracle_cpu(fmt, route, want, sinks, monkeypatch):
    """The builder's choice of dense requests (`prefill.dense_rows`), their device lengths and offsets, the empty rows
    and the merges of up to two prefix pieces: every mix of dense and fused requests matches the oracle (CPU: KVX's
    checked gather and the reference core stand in for `gather_bound` and FlashAttention)."""
    assert _check_dense("cpu", fmt, "mixed", *route, monkeypatch, sinks=sinks) == want


@pytest.mark.vllm
def test_dense_prefixes_of_fresh_prompts_cpu(monkeypatch):
    """Requests without a cached prefix (the host bounds say so) get no prefix piece at all: neither a gather nor the
    fused plan runs, the new tokens' attention is the output."""
    assert _check_dense("cpu", "nvfp4", "fresh", 1, 1024, monkeypatch) == ([], False)


@pytest.mark.vllm
def test_dense_rows_by_hand():
    from kvx_vllm.prefill import DENSE_MIN_QUERY, dense_rows

    big = DENSE_MIN_QUERY
    assert dense_rows([big, big - 1, big, 1, big], [10, 10, 0, 10, 10], 100) == [True, False, False, False, True]
    assert dense_rows([big, big, big], [60, 50, 40], 100) == [True, False, True]  # in batch order while they fit
    assert dense_rows([big], [101], 100) == [False]
    assert dense_rows([], [], 100) == []


@pytest.mark.gpu
@pytest.mark.parametrize("route, want", DENSE_CASES)
@pytest.mark.parametrize("fmt", ["nvfp4", "int4", "fp8_e4m3", "int8"])
def test_dense_prefixes_match_the_oracle_cuda(fmt, route, want, monkeypatch):
    """On the GPU: `gather_bound` over the bound layer and vLLM's FlashAttention for the dense piece."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU with vLLM 0.26 (the GPU machine)")
    assert _check_dense("cuda", fmt, "mixed", *route, monkeypatch) == want


@pytest.mark.vllm
@pytest.mark.parametrize("fmt, window", [("nvfp4", None), ("int4_rot", 127)])
def test_the_builder_warm_up_pages_are_the_runs_layout_cpu(fmt, window):
    """The metadata builder's warm-up (`KvxMetadataBuilder._warm_up`, CUDA only in serving) over a scratch page of the
    run's layout: on the CPU no kernel serves the pages, so it plans and launches nothing (0); what it builds (the
    page, its descriptor, the prefix plan with the group's options) is checked here, the launches on the GPU machine
    (tests/kernels/test_prefill_warmup.py)."""
    from types import SimpleNamespace

    from kvx_core.formats import get_format
    from kvx_vllm.backend import KvxMetadataBuilder

    builder = SimpleNamespace(format=get_format(fmt), num_qo_heads=8, q_dtype=torch.bfloat16, sm_scale=0.125,
                              softcap=None, window=window)
    spec = SimpleNamespace(num_kv_heads=2, head_size=64, block_size=16)
    assert KvxMetadataBuilder._warm_up(builder, spec, torch.device("cpu")) == 0
