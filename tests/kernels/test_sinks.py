"""Attention sinks on the kernels (CUDA when present, else the Triton interpreter): the split merge of the decode
and the prefill's final normalisation against an FP64 oracle (`oracle.ref_decode` / the reference prefill without
sinks, then the sinks joined by their definition, `oracle.with_sinks`); the dispatch paths (centered caches join
them after the kernel, a bound layer's hot path, the routing of CUDA plans); a negligible sink changes no bit; a fuzz
test of forged sinks through the kernel paths.

Sinks are one logit per query head; the LSE returned is the log of the whole denominator (`ops.attention`)."""
from dataclasses import replace

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.formats import get_format
from kvx_core.ops import attention, dispatch
from kvx_core.ops.decode import plan_decode
from kvx_core.ops.triton.merge import merge_splits
from kvx_core.ops.triton.prefill import plan_prefill

from ..cache.test_sinks import check_accepted, forged_sinks
from ..fuzz import run_capped
from .helpers import close_attention, filled_cache, packed_tables
from .oracle import make_pools, make_table, ref_decode, with_sinks

FAMILIES = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4_32", "k8v4_rot", "nvfp4_rot"]
SINKS = {
    "mixed": lambda hq: torch.tensor([-1e4, 1e4, 0.0, 2.5, -3.0, 7.0, 0.5, -0.25] * (hq // 8 + 1))[:hq],
    "zero": lambda hq: torch.zeros(hq),
    "drown": lambda hq: torch.full((hq,), 1e4),
    "vanish": lambda hq: torch.full((hq,), -1e4),
}


def _check(o, lse, ro, rl, tol=1e-2, lse_tol=2e-2):
    """Output within `tol` (relative, Frobenius), the same finite LSEs, within `lse_tol` (absolute, relative
    above 1)."""
    o, lse, ro, rl = o.cpu().double(), lse.cpu().double(), ro.double(), rl.double()
    assert not torch.isnan(o).any()
    assert float((o - ro).norm()) <= tol * max(float(ro.norm()), 1e-6)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    fin = torch.isfinite(rl)
    assert bool(((lse[fin] - rl[fin]).abs() <= lse_tol * rl[fin].abs().clamp_min(1.0)).all())


def _decode(name, device, lens, sinks, *, hkv=2, qh=4, d=64, bs=16, splits=None, softcap=None, window=None, seed=0):
    """The Triton decode + merge with `sinks(hq)` (a plan's field, as `ops.dispatch` sets it; None: none) ->
    (out, lse, ref_out, ref_lse, sinks), the reference by the definition."""
    fmt = get_format(name)
    nb = sum(-(-n // bs) for n in lens) + 3
    g = torch.Generator().manual_seed(seed)
    kg = torch.rand(hkv, generator=g) + 0.5 if fmt.k.uses_global_scale else None
    vg = torch.rand(hkv, generator=g) + 0.5 if fmt.v.uses_global_scale else None
    kd, ks, vd, vs = make_pools(fmt, nb, hkv, bs, d, device=device, seed=seed, k_gs=kg, v_gs=vg)
    bt, sl = make_table(lens, bs, nb, device=device, seed=seed), torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hkv * qh, d, generator=g).to(torch.bfloat16).to(device)
    s = sinks(hkv * qh)
    plan = plan_decode(fmt, batch=len(lens), num_qo_heads=hkv * qh, num_kv_heads=hkv, head_dim=d, block_size=bs,
                       q_dtype=q.dtype, device=device, max_seq_len=max(lens), softcap=softcap, window=window,
                       num_splits=splits, block_n=16, backend="triton")
    plan = replace(plan, sinks=None if s is None else s.to(device))
    kgd, vgd = (None if x is None else x.to(device) for x in (kg, vg))
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    o, lse = plan.run(q, kd, ks, vd, vs, kgd, vgd, bt, sl, out=out)
    ro, rl = ref_decode(q, fmt, kd, ks, vd, vs, kg, vg, bt, sl, softcap=softcap, window=window)
    return (o, lse, *((ro, rl) if s is None else with_sinks(ro, rl, s)), s)


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_merge_joins_the_sink_once(name, sinks, device):
    """Every format family, one split and three (the sink joins once, in the merge, not per split), an empty
    sequence (output 0, LSE = the sink, exactly)."""
    for splits in (1, 3):
        o, lse, ro, rl, s = _decode(name, device, [37, 0, 1, 70], SINKS[sinks], splits=splits)
        _check(o, lse, ro, rl)
        assert bool((o[1] == 0).all()) and torch.equal(lse[1].cpu(), s)


@pytest.mark.parametrize("qh,hkv", [(1, 2), (8, 1), (5, 1)])
@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int4"])
def test_decode_sinks_gqa_softcap_window(qh, hkv, name, device):
    """Each query head its own sink, whatever the group; the sink is neither soft-capped nor windowed."""
    o, lse, ro, rl, _ = _decode(name, device, [20, 33], SINKS["mixed"], hkv=hkv, qh=qh, splits=2, softcap=5.0,
                                window=17)
    _check(o, lse, ro, rl)


def _prefill_case(name, device, lens, q_lens, *, hkv=2, qh=4, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 2
    c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_dim=d, device=device,
                     per_head_global_scale=True)
    if c.layers[0].k_global is not None:
        c.set_global_scales(0, torch.rand(hkv, generator=g) * 0.01 + 0.002, torch.rand(hkv, generator=g) * 0.01 + 0.002)
    bt = make_table(lens, bs, nb, seed=seed)
    slots = torch.cat([bt[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for b, n in enumerate(lens)])
    k, v = torch.randn(len(slots), hkv, d, generator=g), torch.randn(len(slots), hkv, d, generator=g)
    c.write(0, k.to(device), v.to(device), slots.to(device))
    qo = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qo[-1]), hkv * qh, d, generator=g).to(torch.bfloat16).to(device)
    return c, q, qo, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _prefill(name, device, lens, q_lens, sinks, *, causal=True, window=None, softcap=None, **kw):
    c, q, qo, bt, sl = _prefill_case(name, device, lens, q_lens, **kw)
    p, hq = c.layers[0], q.shape[1]
    s = sinks(hq)
    plan = plan_prefill(c.format, qo, num_qo_heads=hq, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        block_size=c.block_size, q_dtype=q.dtype, device=device, causal=causal, softcap=softcap,
                        window_left=window, block_m=32, block_n=16)
    out = torch.full_like(q, float("nan"))
    plan = replace(plan, sinks=None if s is None else s.to(device))
    o, lse = plan.run(q, p.k_data, p.k_scales, p.v_data, p.v_scales, p.k_global, p.v_global, bt, sl, out=out)
    ro, rl = attention.paged_prefill(q.float(), qo, c.descriptor(0), BlockTable.packed(bt), SeqLens(sl),
                                     causal=causal, softcap=softcap, window=window)  # no sinks: the oracle joins them
    return (o, lse, *((ro, rl) if s is None else with_sinks(ro.cpu(), rl.cpu(), s)), s)


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_normalisation_joins_the_sink(name, sinks, device):
    """Causal extends (a fresh prompt, an extend over a prefix, one token) with a window, and the non-causal
    attention over cached prefixes one of which is empty (its rows: output 0, LSE = the sink, exactly)."""
    o, lse, ro, rl, _ = _prefill(name, device, [20, 45, 9], [20, 13, 1], SINKS[sinks], window=11)
    _check(o, lse, ro, rl)
    o, lse, ro, rl, s = _prefill(name, device, [0, 30, 7], [3, 5, 2], SINKS[sinks], causal=False)
    _check(o, lse, ro, rl)
    assert bool((o[:3] == 0).all()) and torch.equal(lse[:3].cpu(), s.expand(3, -1))


@pytest.mark.parametrize("qh,hkv", [(1, 2), (8, 1), (5, 1)])
def test_prefill_sinks_gqa_softcap(qh, hkv, device):
    o, lse, ro, rl, _ = _prefill("nvfp4", device, [40, 9], [17, 9], SINKS["mixed"], hkv=hkv, qh=qh, softcap=5.0)
    _check(o, lse, ro, rl)


def test_a_negligible_sink_changes_no_bit_and_an_overwhelming_one_takes_all_the_mass(device):
    """-3.4e38 (FP32's edge): the same bits as without sinks, decode over three splits and prefill; +3.4e38: output
    0 and LSE = the sink, finite (the kernels join in the natural-log domain: times log2(e) it would overflow)."""
    none = lambda hq: None  # noqa: E731
    o0, lse0, *_ = _decode("nvfp4", device, [37, 5], none, splits=3)
    p0, pl0, *_ = _prefill("int8", device, [20, 9], [20, 1], none)
    for sink in (-3.4e38, 3.4e38):
        const = lambda hq, x=sink: torch.full((hq,), x)  # noqa: E731
        o, lse, *_ = _decode("nvfp4", device, [37, 5], const, splits=3)
        p, pl, *_ = _prefill("int8", device, [20, 9], [20, 1], const)
        if sink < 0:
            assert torch.equal(o, o0) and torch.equal(lse, lse0) and torch.equal(p, p0) and torch.equal(pl, pl0)
        else:
            for out, lse_t in ((o, lse), (p, pl)):
                assert bool((out == 0).all()) and bool((lse_t.cpu() == torch.tensor(sink)).all())


def test_merge_splits_against_the_definition(device):
    """The merge alone on adversarial partials: empty splits (-inf), a row of only empty splits, an underflowing
    split; out = sum_s 2^l_s o_s / (exp(sink) + sum_s 2^l_s), lse = ln of that denominator."""
    g = torch.Generator().manual_seed(5)
    b, hq, ns, d = 3, 4, 5, 64
    mid_o = torch.randn(b, hq, ns, d, generator=g)
    mid_l = torch.randn(b, hq, ns, generator=g) * 20
    mid_l[0, :, 1:3] = float("-inf")
    mid_l[1] = float("-inf")
    mid_l[2, 0, 0] = -300.0
    sinks = torch.tensor([0.0, 30.0, -30.0, 1e4])
    out = torch.full((b, hq, d), float("nan"), dtype=torch.float32, device=device)
    lse = torch.full((b, hq), float("nan"), dtype=torch.float32, device=device)
    merge_splits(mid_o.to(device), mid_l.to(device), out, lse, sinks.to(device))
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    l_nat = mid_l.double() * ln2  # the splits' log-sum-exps, natural log
    m = torch.maximum(l_nat.amax(-1), sinks.double())
    w = torch.exp(l_nat - m[..., None])
    denom = w.sum(-1) + torch.exp(sinks.double() - m)
    ref_o = (w[..., None] * mid_o.double()).sum(-2) / denom[..., None]
    torch.testing.assert_close(out.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), m + torch.log(denom), rtol=1e-6, atol=1e-5)
    assert bool((out[1] == 0).all()) and torch.equal(lse[1].cpu(), sinks)


# ---------------------------------------------------------------- dispatch
def _close(got, ref, tol=2e-2):
    """`close_attention`, and the finite LSEs within `tol` of the reference's."""
    close_attention(got, ref, tol)
    lse, rl = got[1].cpu(), ref[1].cpu()
    fin = torch.isfinite(rl)
    assert bool(((lse[fin] - rl[fin]).abs() <= tol * rl[fin].abs().clamp_min(1.0)).all())


@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "k8v4_rot"])
def test_dispatch_kernel_paths_with_sinks_match_the_reference(name, device, monkeypatch):
    """`ops.dispatch` on the kernels (decode, prefill with a window, the plan's `with_sinks` for another layer,
    and a bound layer's hot path) agrees with the reference attention with the same sinks."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    desc = filled_cache(name, device, page_buffer=True, seed=3).descriptor(0)
    table, lens = packed_tables(device)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 4, 64, generator=g).to(torch.bfloat16).to(device)
    qo = torch.tensor([0, 5, 5, 6, 9], dtype=torch.int32)
    qp = torch.randn(9, 4, 64, generator=g).to(torch.bfloat16).to(device)
    s1, s2 = torch.tensor([-1e4, 1e4, 0.0, 3.0], device=device), torch.tensor([2.0, -2.0, 0.5, 9.0], device=device)
    _close(dispatch.paged_decode(q, desc, table, lens, softcap=20.0, sinks=s1),
           attention.paged_decode(q, desc, table, lens, softcap=20.0, sinks=s1))
    _close(dispatch.paged_prefill(qp, qo, desc, table, lens, window=6, sinks=s1),
           attention.paged_prefill(qp, qo, desc, table, lens, window=6, sinks=s1))
    plan = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                q_dtype=q.dtype, device=device, sinks=s1, check=False, max_seq_len=13)
    layer2 = plan.with_sinks(s2)
    _close(layer2.run(q, desc), attention.paged_decode(q, desc, table, lens, sinks=s2))
    fast, none = layer2.run(q, dispatch.bind(desc), want_lse=False)  # the engine's hot path: decode + merge only
    same = dict(rtol=0, atol=0, equal_nan=True)
    assert none is None
    torch.testing.assert_close(fast, layer2.run(q, desc)[0], **same)
    torch.testing.assert_close(plan.with_sinks(None).run(q, desc), dispatch.paged_decode(q, desc, table, lens), **same)
    # a layer's sinks given to `run` (the engine's per-layer call, no plan copy) replace the plan's: same bits
    bound = dispatch.bind(desc)
    for s in (s2, s1):  # back and forth: the bound path keys its step arguments by the sinks' address
        by_run, _ = plan.run(q, bound, want_lse=False, sinks=s)
        torch.testing.assert_close(by_run, plan.with_sinks(s).run(q, bound, want_lse=False)[0], **same)
    torch.testing.assert_close(plan.run(q, desc, sinks=s2), layer2.run(q, desc), **same)


@pytest.mark.parametrize("name", ["nvfp4", "int8", "k8v4_rot"])
def test_centered_cache_joins_the_sink_after_the_kernel(name, device, monkeypatch):
    """Over a centered cache the kernels' logits are q . (k - c), shifted per row: the sink joins after the LSE
    is restored (`center_lse`), also for a bound layer's LSE-free run; smoothing alone shifts nothing."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    nb, bs, h, d = 8, 4, 2, 64
    g = torch.Generator().manual_seed(7)
    offset = torch.randn(h, d, generator=g) * 8
    k = (torch.randn(nb * bs, h, d, generator=g) + offset).bfloat16().to(device)
    v = torch.randn(nb * bs, h, d, generator=g).bfloat16().to(device)
    c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=h, head_dim=d, device=device)
    c.set_key_center(0, offset + 0.5)
    c.set_key_smoothing(0, torch.rand(h, d, generator=g) * 3 + 0.3)
    c.write(0, k, v, torch.randperm(nb * bs, generator=g).to(device))
    desc = c.descriptor(0)
    lens = SeqLens(torch.tensor([nb * bs, 0, 9], dtype=torch.int32, device=device))
    table = BlockTable.packed(torch.tensor([list(range(nb)), [0] * nb, [7, 6, 5, 0, 0, 0, 0, 0]],
                                           dtype=torch.int32).to(device))
    s = torch.tensor([1.0, -4.0, 30.0, 0.0], device=device)
    q = torch.randn(3, 2 * h, d, generator=g).bfloat16().to(device)
    qp = torch.randn(5, 2 * h, d, generator=g).bfloat16().to(device)
    qo = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    for got, want in ((dispatch.paged_decode(q, desc, table, lens, sinks=s),
                       attention.paged_decode(q, desc, table, lens, sinks=s)),
                      (dispatch.paged_prefill(qp, qo, desc, table, lens, sinks=s),
                       attention.paged_prefill(qp, qo, desc, table, lens, sinks=s))):
        o, ro, lse, rl = got[0].float().cpu(), want[0].float().cpu(), got[1].cpu(), want[1].cpu()
        assert float((o - ro).norm() / ro.norm()) < 3e-2  # the bf16 rounding of q * s, as without sinks
        assert float((lse - rl).abs().max()) < 5e-3 * float(rl.abs().max())
    plan = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=2 * h, num_kv_heads=h, head_dim=d, block_size=bs,
                                q_dtype=q.dtype, device=device, sinks=s, check=False, max_seq_len=nb * bs)
    fast, _ = plan.run(q, dispatch.bind(desc), want_lse=False)
    assert torch.equal(fast, plan.run(q, desc)[0])
    unsunk = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=2 * h, num_kv_heads=h, head_dim=d,
                                  block_size=bs, q_dtype=q.dtype, device=device, check=False, max_seq_len=nb * bs)
    late, _ = unsunk.run(q, dispatch.bind(desc), want_lse=False, sinks=s)  # a layer's sinks, given to run
    assert torch.equal(late, fast)


def test_a_cuda_decode_plan_with_sinks_stays_on_cuda(device, monkeypatch):
    """The CUDA library's split merge joins the sinks (`ops/cuda/decode.py`): a CUDA plan keeps its backend, splits
    and workspace, forced or not."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    table, lens = packed_tables(device)
    plan = dispatch.plan_decode(table, lens, fmt="nvfp4", num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                q_dtype=torch.bfloat16, device=device, check=False, max_seq_len=13)
    s = torch.zeros(4, device=device)
    for forced in (False, True):
        cuda = replace(plan, kernel=replace(plan.kernel, backend="cuda", reason=None, forced=forced))
        kept = cuda.with_sinks(s).kernel
        assert kept.backend == "cuda" and kept.sinks is s and kept.reason is None
        assert kept.num_splits == plan.kernel.num_splits and kept.mid_o is plan.kernel.mid_o


_FUZZ: dict = {}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the `device` fixture's, for the fuzz subprocess


def kernel_sinks_target(rng) -> None:
    """Under the fuzz harness (the interpreter off CUDA): `forged_sinks` through the kernel paths of `ops.dispatch`
    (decode and its split merge, prefill): only KvxError may escape, accepted sinks give what `check_accepted`
    states."""
    if not _FUZZ:
        dispatch._kernel_device = lambda device: True  # this process only serves the fuzz cases
        c = PagedKVCache("nvfp4", num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=32,
                         device=DEVICE)
        g = torch.Generator().manual_seed(4)
        c.write(0, torch.randn(64, 2, 32, generator=g).to(DEVICE), torch.randn(64, 2, 32, generator=g).to(DEVICE),
                torch.arange(64, device=DEVICE))
        table = torch.tensor([[0, 0, 0], [1, 2, 3], [0, 0, 0]], dtype=torch.int32, device=DEVICE)
        _FUZZ.update(desc=c.descriptor(0), table=BlockTable.packed(table),
                     lens=SeqLens(torch.tensor([0, 40, 9], dtype=torch.int32, device=DEVICE)),
                     q=torch.randn(7, 4, 32, generator=g).bfloat16().to(DEVICE))
    f = _FUZZ
    sinks = forged_sinks(rng)
    if isinstance(sinks, torch.Tensor):
        sinks = sinks.to(DEVICE)
    check_accepted(sinks, *dispatch.paged_decode(f["q"][:3], f["desc"], f["table"], f["lens"], sinks=sinks))
    qo = torch.tensor([0, 0, 4, 7], dtype=torch.int32)
    check_accepted(sinks, *dispatch.paged_prefill(f["q"], qo, f["desc"], f["table"], f["lens"], sinks=sinks))


def test_fuzz_forged_sinks_on_the_kernels():
    run_capped("tests.kernels.test_sinks:kernel_sinks_target", cases=80, env={"TRITON_INTERPRET": "1"}
               if DEVICE == "cpu" else None)
