"""Split-KV Triton prefill (few queries over a long cached prefix: each program's keys split S ways, merged by
`merge.merge_splits`) against the unsplit kernel and an FP64 oracle (`oracle.dense_kv` + `attention.attend` on the
formats' own decode, sinks joined by their definition, `oracle.with_sinks`), and the plan's choice of S.

Under the interpreter the splits are forced (`plan_prefill(num_splits=...)`) over short sequences with small tiles
(BLOCK_N 16: a split is a tile or two), so that splits start inside causal diagonals and window edges, some rows see
no key of a split (causal, window) and some splits none at all (more splits than tiles)."""
from dataclasses import replace

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.ops import attention, dispatch
from kvx_core.ops.attention import attend
from kvx_core.ops.triton import prefill
from kvx_core.ops.triton.prefill import plan_prefill, prefill_num_splits

from .oracle import dense_kv, make_pools, make_table, with_sinks

FAMILIES = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4_32", "k8v4_rot", "nvfp4_rot"]
TILES = {"block_m": 16, "block_n": 16, "num_warps": 4}  # QH = 4: 4 query tokens per program
WIDE = {"block_m": 64, "block_n": 16, "num_warps": 4}  # 16 query tokens per program: rows far apart in one program


def _case(name: str, device: str, lens: list[int], q_lens: list[int], *, hkv=2, qh=4, d=64, bs=16, seed=0) -> dict:
    fmt = get_format(name)
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 2
    kg = torch.rand(hkv, generator=g) + 0.5 if fmt.k.uses_global_scale else None
    vg = torch.rand(hkv, generator=g) + 0.5 if fmt.v.uses_global_scale else None
    pools = make_pools(fmt, nb, hkv, bs, d, device=device, seed=seed, k_gs=kg, v_gs=vg)
    qo = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(qo[-1]), hkv * qh, d, generator=g).to(torch.bfloat16).to(device)
    return dict(fmt=fmt, pools=pools, kg=kg, vg=vg, bt=make_table(lens, bs, nb, device=device, seed=seed),
                sl=torch.tensor(lens, dtype=torch.int32, device=device), qo=qo, q=q, lens=lens, q_lens=q_lens)


def _kernel(c: dict, splits: int, sinks=None, *, causal=True, window=None, softcap=None, queries_after=False,
            tiles=TILES):
    """The Triton prefill with `splits` forced -> (out, lse), into NaN-poisoned buffers (every element written)."""
    q, fmt, device = c["q"], c["fmt"], c["q"].device
    hkv = c["pools"][0].shape[1]
    plan = plan_prefill(fmt, c["qo"], num_qo_heads=q.shape[1], num_kv_heads=hkv, head_dim=q.shape[2],
                        block_size=c["pools"][0].shape[2], q_dtype=q.dtype, device=device, causal=causal,
                        softcap=softcap, window_left=window, queries_after=queries_after, num_splits=splits, **tiles)
    assert plan.num_splits == splits and (plan.mid_o is None) == (splits == 1)
    if sinks is not None:
        plan = replace(plan, sinks=sinks.to(device))
    kd, ks, vd, vs = c["pools"]
    kg, vg = (None if x is None else x.to(device) for x in (c["kg"], c["vg"]))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"), device=device)
    return plan.run(q, kd, ks, vd, vs, kg, vg, c["bt"], c["sl"], out=out, lse=lse)


def _oracle(c: dict, sinks=None, *, causal=True, window=None, softcap=None, queries_after=False):
    """FP64 (out, lse): sequence b's queries at positions `prefix + i` (prefix = L - q_len, or L with
    `queries_after`) over its K/V as the format decodes them."""
    fmt, q = c["fmt"], c["q"]
    outs, lses = [], []
    for b, (n, t) in enumerate(zip(c["lens"], c["q_lens"], strict=True)):
        k, v = dense_kv(fmt, *c["pools"], c["kg"], c["vg"], c["bt"], n, b)
        first = int(c["qo"][b])
        qq = fmt.rotate_q(q[first:first + t].cpu().double())
        pos = torch.arange(t) + (n if queries_after else n - t)
        o, lse = attend(qq, k, v, pos, q.shape[2] ** -0.5, softcap, window, causal)
        outs.append(fmt.unrotate_output(o))
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if sinks is None else with_sinks(out, lse, sinks)


def _close(o, lse, ro, rl, tol=1e-2, lse_tol=2e-2) -> None:
    """Output within `tol` (relative, Frobenius), the same finite LSEs, within `lse_tol` (absolute, relative
    above 1): the existing prefill tolerances."""
    o, lse, ro, rl = o.cpu().double(), lse.cpu().double(), ro.double(), rl.double()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert float((o - ro).norm()) <= tol * max(float(ro.norm()), 1e-6)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    fin = torch.isfinite(rl)
    assert bool(((lse[fin] - rl[fin]).abs() <= lse_tol * rl[fin].abs().clamp_min(1.0)).all())


@pytest.mark.parametrize("name", FAMILIES)
def test_split_matches_unsplit_and_oracle(name, device):
    """Every format family, causal, a ragged batch: one token over a long prefix, a fresh prompt of several
    programs (q_len 9 > BLOCK_M / QH), a short extend; 3 splits vs 1 (a few bf16 roundings apart) and vs FP64."""
    c = _case(name, device, [90, 9, 30], [1, 9, 6])
    o1, l1 = _kernel(c, 1)
    o3, l3 = _kernel(c, 3)
    ro, rl = _oracle(c)
    _close(o3, l3, ro, rl)
    _close(o3, l3, o1.cpu().double(), l1.cpu().double(), tol=8e-3, lse_tol=1e-4)


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "k8v4_rot"])
def test_split_over_a_cached_prefix(name, device):
    """causal=False over the cached prefix, the queries right after it (vLLM's split prefill) or at its end; an
    empty prefix (output 0, LSE -inf in every split and after the merge); more splits than key tiles."""
    c = _case(name, device, [70, 0, 20], [16, 3, 2])
    o, lse = _kernel(c, 4, causal=False, queries_after=True)
    _close(o, lse, *_oracle(c, causal=False, queries_after=True))
    assert bool((o[16:19] == 0).all()) and bool(torch.isneginf(lse[16:19]).all())
    c = _case(name, device, [70, 20], [16, 2])
    o, lse = _kernel(c, 4, causal=False)
    _close(o, lse, *_oracle(c, causal=False))


@pytest.mark.parametrize("name", ["int8", "mxfp4_32"])
def test_split_window_rows_that_miss_whole_splits(name, device):
    """Programs of 16 query tokens with a window of 8 split 3 ways: a row's window sees one split and misses the
    others (their partial is empty: lse2 -inf, no weight), causal and with the queries after a prefix."""
    c = _case(name, device, [60, 25], [20, 25])
    o, lse = _kernel(c, 3, window=8, tiles=WIDE)
    _close(o, lse, *_oracle(c, window=8))
    c = _case(name, device, [60], [20])
    o, lse = _kernel(c, 3, causal=False, window=8, queries_after=True, tiles=WIDE)
    _close(o, lse, *_oracle(c, causal=False, window=8, queries_after=True))


@pytest.mark.parametrize("sinks", [1e4, -1e4, "mixed"])
def test_split_joins_the_sink_once(sinks, device):
    """Huge / tiny / mixed sinks: joined once by the merge (not per split), also in rows with no key at all (their
    LSE: the sink)."""
    hq = 8
    s = torch.tensor([-1e4, 1e4, 0.0, 2.5, -3.0, 7.0, 0.5, -0.25]) if sinks == "mixed" else torch.full((hq,), sinks)
    c = _case("int4", device, [70, 9], [3, 9])
    o, lse = _kernel(c, 3, s)
    _close(o, lse, *_oracle(c, s))
    c = _case("nvfp4", device, [40, 0], [2, 2])
    o, lse = _kernel(c, 3, s, causal=False, queries_after=True)
    _close(o, lse, *_oracle(c, s, causal=False, queries_after=True))
    assert bool((o[2:] == 0).all()) and torch.equal(lse[2:].cpu(), s.expand(2, -1))


@pytest.mark.parametrize("qh,hkv", [(4, 2), (5, 1)])
def test_split_softcap_gqa(qh, hkv, device):
    c = _case("nvfp4", device, [75, 20], [1, 12], qh=qh, hkv=hkv)
    o, lse = _kernel(c, 2, softcap=5.0)
    _close(o, lse, *_oracle(c, softcap=5.0))


def test_plan_splits_few_programs_over_long_keys(monkeypatch):
    """H200 geometry (132 SMs, GQA 32/8, D 128): 16 tokens over a 32k prefix split (8 programs, each of 32k keys:
    32 splits of 1024 keys, the workspace T x Hq x S x D); a 4096-token prompt (1024 programs), a step without the
    hint, and short sequences do not. The CPU plan uses the interpreter's stand-in of 4 SMs."""
    assert prefill_num_splits(8, 32768 + 16, 128, 132) == 32
    assert prefill_num_splits(1024, 4096, 128, 132) == 1
    assert prefill_num_splits(8, None, 128, 132) == 1
    assert prefill_num_splits(8, 1000, 128, 132) == 1  # under two splits of MIN_SPLIT_TILES tiles
    monkeypatch.setattr(prefill, "sm_count", lambda device: 132)
    geo = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16, q_dtype=torch.bfloat16, device="cpu")
    p = plan_prefill("nvfp4", torch.tensor([0, 16]), max_seq_len=32768 + 16, **geo)
    assert p.num_splits == 32 and tuple(p.mid_o.shape) == (16, 32, 32, 128) and tuple(p.mid_l.shape) == (16, 32, 32)
    p = plan_prefill("int4", torch.tensor([0, 16]), max_seq_len=32768 + 16, causal=False, queries_after=True, **geo)
    assert p.num_splits > 1
    p = plan_prefill("nvfp4", torch.tensor([0, 4096]), max_seq_len=4096, **geo)
    assert p.num_splits == 1 and p.mid_o is None and p.mid_l is None
    assert plan_prefill("nvfp4", torch.tensor([0, 16]), **geo).num_splits == 1
    # a window bounds each program's keys whatever the sequence length
    assert plan_prefill("nvfp4", torch.tensor([0, 16]), max_seq_len=32768, window_left=1000, **geo).num_splits == 1


@pytest.mark.parametrize("bad", [{"num_splits": 0}, {"num_splits": 1.5}, {"num_splits": True},
                                 {"num_splits": prefill.MAX_SPLITS + 1}, {"max_seq_len": -1},
                                 {"max_seq_len": 2.5}, {"max_seq_len": True}])
def test_plan_refuses_bad_split_arguments(bad):
    with pytest.raises(KvxError) as e:
        plan_prefill("bf16", torch.tensor([0, 4]), num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     q_dtype=torch.bfloat16, device="cpu", **bad)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_dispatch_plan_splits_from_the_hint(device, monkeypatch):
    """`dispatch.plan_prefill(max_seq_len=...)` (the vLLM builder's call) reaches the kernel plan: one program (one
    KV head, 2 queries) against the 4 SMs the interpreter stands for, over 300 keys, splits (1-tile splits allowed
    here to keep the interpreter fast), and the step matches the reference; without the hint it does not split."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    monkeypatch.setattr(prefill, "MIN_SPLIT_TILES", 1)
    c = PagedKVCache("bf16", num_layers=1, num_blocks=20, block_size=16, num_kv_heads=1, head_dim=64, device=device)
    g = torch.Generator().manual_seed(4)
    n = 300
    c.write(0, torch.randn(n, 1, 64, generator=g).to(device), torch.randn(n, 1, 64, generator=g).to(device),
            torch.arange(n).to(device))
    table = BlockTable.packed(torch.arange(19, dtype=torch.int32).view(1, 19).to(device))
    lens = SeqLens(torch.tensor([n], dtype=torch.int32).to(device))
    qo = torch.tensor([0, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=g).bfloat16().to(device)
    geo = dict(fmt="bf16", num_qo_heads=4, num_kv_heads=1, head_dim=64, block_size=16, q_dtype=torch.bfloat16,
               device=device)
    assert dispatch.plan_prefill(qo, table, lens, **geo).kernel.num_splits == 1
    plan = dispatch.plan_prefill(qo, table, lens, max_seq_len=n, **geo)
    assert plan.kernel.num_splits == 2
    o, lse = plan.run(q, c.descriptor(0))
    ro, rl = attention.paged_prefill(q.float(), qo, c.descriptor(0), table, lens)
    _close(o, lse, ro.cpu(), rl.cpu())
