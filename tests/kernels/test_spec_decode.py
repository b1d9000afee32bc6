"""Multi-row decode (speculative decoding's verification step: 1 + k query rows per sequence, `rows_per_seq`) on the
kernels (CUDA when present, else the Triton interpreter) against the FP64 oracle (`oracle.ref_decode` with
`rows_per_seq`: row t of a sequence of L cached tokens sits at position L - R + t and attends causally), on ragged
lengths (L = R, one page, many pages), empty sequences, GQA, every format, window / softcap / sinks; the dispatch
plans (kernel and reference paths, a bound layer's hot path) against the reference, which itself equals the
prefill of R new tokens; refusals (bad rows_per_seq, sequences shorter than their rows) that change nothing; and
the row lengths living in the caller's workspace (CUDA graphs replay one address)."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, list_formats
from kvx_core.ops import attention, dispatch
from kvx_core.ops.decode import plan_decode, workspace_size

from . import host_decode
from .helpers import filled_cache
from .oracle import make_pools, make_table, ref_decode, with_sinks

ALL = list_formats()


def _pools(name, device, lens, hkv, qh, d, bs, seed, q_rows):
    """(fmt, pools, global scales (CPU and device), block table, seq_lens, q [q_rows, Hq, D] bf16)."""
    fmt = get_format(name)
    nb = sum(math.ceil(n / bs) for n in lens) + 3
    g = torch.Generator().manual_seed(seed)
    kg = torch.rand(hkv, generator=g) + 0.5 if fmt.k.uses_global_scale else None
    vg = torch.rand(hkv, generator=g) + 0.5 if fmt.v.uses_global_scale else None
    kd, ks, vd, vs = make_pools(fmt, nb, hkv, bs, d, device=device, seed=seed, k_gs=kg, v_gs=vg)
    bt = make_table(lens, bs, nb, device=device, seed=seed)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(q_rows, hkv * qh, d, generator=g).to(torch.bfloat16).to(device)
    dev = tuple(None if x is None else x.to(device) for x in (kg, vg))
    return fmt, (kd, ks, vd, vs), (kg, vg), dev, bt, sl, q


def _run(name, device, lens, r, *, hkv=2, qh=4, d=64, bs=16, splits=None, softcap=None, window=None, sinks=None,
         seed=0, backend="triton"):
    """The kernel decode + merge of `len(lens) * r` rows -> (out, lse, oracle out, oracle lse)."""
    fmt, (kd, ks, vd, vs), (kg, vg), (kgd, vgd), bt, sl, q = _pools(name, device, lens, hkv, qh, d, bs, seed,
                                                                    len(lens) * r)
    plan = plan_decode(fmt, batch=len(lens) * r, num_qo_heads=hkv * qh, num_kv_heads=hkv, head_dim=d, block_size=bs,
                       q_dtype=q.dtype, device=device, max_seq_len=max(lens), softcap=softcap, window=window,
                       num_splits=splits, block_n=16, backend=backend, rows_per_seq=r)
    if sinks is not None:
        plan = replace(plan, sinks=sinks.to(device))
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    o, lse = plan.run(q, kd, ks, vd, vs, kgd, vgd, bt, plan.row_lens(sl), out=out)
    ro, rl = ref_decode(q, fmt, kd, ks, vd, vs, kg, vg, bt, sl, softcap=softcap, window=window, rows_per_seq=r)
    if sinks is not None:
        ro, rl = with_sinks(ro, rl, sinks)
    return o.cpu().double(), lse.cpu().double(), ro, rl


def _check(o, lse, ro, rl, tol=1e-2, lse_tol=2e-2):
    """Output within `tol` (relative, Frobenius), the same finite LSEs, within `lse_tol` (absolute, relative
    above 1)."""
    assert not torch.isnan(o).any()
    assert float((o - ro).norm()) <= tol * max(float(ro.norm()), 1e-6)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert bool(((lse[fin] - rl[fin]).abs() <= lse_tol * rl[fin].abs().clamp_min(1.0)).all())


# ---------------------------------------------------------------- the kernels
@pytest.mark.parametrize("name", ALL)
def test_multi_row_decode_every_format(name, device):
    """Every format (rotated ones included): 4 rows per sequence over ragged lengths (exactly 4, across pages,
    one page), two splits."""
    _check(*_run(name, device, [37, 4, 70, 16], 4, splits=2))


@pytest.mark.parametrize("name,sinks", [("nvfp4", False), ("int4_rot", False), ("k8v4", True), ("mxfp4_32", True)])
def test_multi_row_decode_cuda_host(name, sinks):
    """The CUDA decode's source built for the CPU (host_decode.py): 4 rows per sequence (each row's causal length
    from the plan's `row_lens`, as engines pass them), two splits, attention sinks in the merge."""
    lens, r, hkv, qh, d = [37, 4, 70, 16], 4, 2, 4, 128
    fmt, pools, (kg, vg), _, bt, sl, q = _pools(name, "cpu", lens, hkv, qh, d, 16, 5, len(lens) * r)
    sk = torch.tensor([0.5, -1.0, 3.0, 0.0, -20.0, 1.5, 2.0, -0.25]) if sinks else None
    plan = plan_decode(fmt, batch=len(lens) * r, num_qo_heads=hkv * qh, num_kv_heads=hkv, head_dim=d, block_size=16,
                       q_dtype=q.dtype, device="cpu", max_seq_len=max(lens), backend="triton", rows_per_seq=r)
    o, lse = host_decode.decode(q, *pools, kg, vg, bt, plan.row_lens(sl), fmt, num_splits=2, sinks=sk,
                                rows_per_seq=r)
    ro, rl = ref_decode(q, fmt, *pools, kg, vg, bt, sl, rows_per_seq=r)
    if sk is not None:
        ro, rl = with_sinks(ro, rl, sk)
    _check(o.double(), lse.double(), ro, rl)


@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "int4_rot"])
def test_rows_of_a_sequence_see_different_prefixes(name, device):
    """Each row attends its own causal prefix: row t of 5 differs from row t + 1 (one more key), and the last row
    of each sequence equals the one-row decode of the whole sequence (bit for bit: the same kernel on the same
    length and block-table row)."""
    lens, r = [21, 5, 48], 5
    o, lse, ro, rl = _run(name, device, lens, r, splits=3)
    _check(o, lse, ro, rl)
    fmt, (kd, ks, vd, vs), _, (kgd, vgd), bt, sl, q = _pools(name, device, lens, 2, 4, 64, 16, 0, len(lens) * r)
    last = q[r - 1::r].contiguous()
    one = plan_decode(fmt, batch=len(lens), num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      q_dtype=q.dtype, device=device, max_seq_len=max(lens), num_splits=3, block_n=16, backend="triton")
    o1, l1 = one.run(last, kd, ks, vd, vs, kgd, vgd, bt, sl)
    assert torch.equal(o1.cpu().double(), o[r - 1::r]) and torch.equal(l1.cpu().double(), lse[r - 1::r])
    assert not torch.equal(o[0], o[1])


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "nvfp4", "mxfp4_32_rot"])
def test_empty_sequences_give_zero_rows(name, device):
    """A length-0 sequence (an engine's padding) gives all its rows 0 and -inf; its neighbours are unaffected."""
    o, lse, ro, rl = _run(name, device, [0, 9, 0, 33], 3, splits=2)
    for b in (0, 2):
        assert bool((o[3 * b:3 * b + 3] == 0).all()) and bool(torch.isneginf(lse[3 * b:3 * b + 3]).all())
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("qh,hkv", [(1, 2), (8, 1), (5, 1), (16, 1)])
@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int4"])
def test_multi_row_decode_gqa(qh, hkv, name, device):
    _check(*_run(name, device, [20, 33], 2, hkv=hkv, qh=qh))


@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int8", "k8v4_rot"])
def test_multi_row_decode_window_softcap(window, name, device):
    """The window counts back from each row's own position (window 3: every row a different key range)."""
    _check(*_run(name, device, [45, 9, 4], 4, softcap=15.0, window=window, splits=2))


@pytest.mark.parametrize("name", ["bf16", "int4", "nvfp4_rot"])
def test_multi_row_decode_sinks(name, device):
    """Sinks join once per row, in the split merge (empty sequences' rows: 0 and the sink)."""
    sinks = torch.tensor([-1e4, 1e4, 0.0, 2.5, -3.0, 7.0, 0.5, -0.25])
    o, lse, ro, rl = _run(name, device, [0, 19, 6], 3, sinks=sinks, splits=2, window=5)
    _check(o, lse, ro, rl)
    assert torch.equal(lse[:3], sinks.double().expand(3, -1))


def test_short_sequence_rows_without_checks_attend_what_exists(device):
    """Sync-free plans (`check=False`) do not read lengths on the host: a sequence shorter than its rows gives the
    rows before its first token 0 and -inf (length max(0, ...)) and the others their causal prefix; no block past
    the sequence is read (its table row is all out-of-range ids beyond the first block)."""
    fmt, (kd, ks, vd, vs), (kg, vg), (kgd, vgd), bt, sl, q = _pools("nvfp4", device, [2, 30], 2, 4, 64, 16, 0, 8)
    bt[0, 1:] = 10**6  # never read
    plan = plan_decode(fmt, batch=8, num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=q.dtype,
                       device=device, max_seq_len=30, block_n=16, backend="triton", rows_per_seq=4)
    lens = plan.row_lens(sl)
    assert lens.cpu().tolist() == [0, 0, 1, 2, 27, 28, 29, 30]
    o, lse = plan.run(q, kd, ks, vd, vs, kgd, vgd, bt, lens)
    ro, rl = ref_decode(q, fmt, kd, ks, vd, vs, kg, vg, bt, sl, rows_per_seq=4)
    _check(o.cpu().double(), lse.cpu().double(), ro, rl)
    assert bool((o[:2] == 0).all()) and bool(torch.isneginf(lse[:2]).all())


def test_row_lengths_live_in_the_workspace(device):
    """The per-row lengths are written into the caller's workspace (one address per batch size, as a CUDA graph
    replays), which `workspace_size(rows_per_seq=...)` sizes for every batch; one plan per step recomputes them."""
    geo = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.bfloat16, device=device)
    n = workspace_size("nvfp4_rot", max_batch=6, max_seq_len=4096, rows_per_seq=4, **geo)
    ws = torch.empty(n, dtype=torch.float32, device=device)
    span = (ws.data_ptr(), ws.data_ptr() + 4 * n)
    for b in range(1, 7):
        plan = plan_decode("nvfp4_rot", batch=4 * b, max_seq_len=4096, workspace=ws, rows_per_seq=4, **geo)
        for step in range(2):
            lens = plan.row_lens(torch.arange(b, dtype=torch.int32, device=device) + 7 + step)
            assert span[0] <= lens.data_ptr() and lens.data_ptr() + 4 * lens.numel() <= span[1]
            assert lens.cpu().tolist() == [x + 7 + step - 3 + t for x in range(b) for t in range(4)]
    with pytest.raises(KvxError) as e:  # a workspace sized for one row per sequence is too small
        plan_decode("nvfp4_rot", batch=24, max_seq_len=4096, rows_per_seq=4, **geo,
                    workspace=torch.empty(workspace_size("nvfp4_rot", max_batch=6, max_seq_len=4096, **geo),
                                          device=device))
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_bad_rows_per_seq_is_refused(bad, device):
    geo = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.bfloat16, device=device,
               max_seq_len=64)
    with pytest.raises(KvxError) as e:
        plan_decode("nvfp4", batch=4, rows_per_seq=bad, **geo)
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError) as e:
        plan_decode("nvfp4", batch=6, rows_per_seq=4, **geo)  # 6 rows are not whole sequences of 4
    assert e.value.status == Status.INVALID_ARGUMENT


def test_integer_types_of_rows_per_seq_become_an_int(device):
    """A numpy integer is an int for the kernels' arguments (ctypes and Triton take plain ints)."""
    plan = plan_decode("nvfp4", batch=4, rows_per_seq=np.int64(2), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, q_dtype=torch.bfloat16, device=device, max_seq_len=64)
    assert type(plan.rows_per_seq) is int and plan.rows_per_seq == 2


def test_row_lens_refuses_lengths_of_another_shape(device):
    plan = plan_decode("int8", batch=8, num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                       q_dtype=torch.bfloat16, device=device, max_seq_len=64, rows_per_seq=4)
    for bad in (torch.ones(8, dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int64, device=device)):
        with pytest.raises(KvxError) as e:
            plan.row_lens(bad)
        assert e.value.status == Status.INVALID_ARGUMENT


# ---------------------------------------------------------------- dispatch and the reference
def _tables(device):
    lens = torch.tensor([13, 0, 3, 9], dtype=torch.int32)
    bt = torch.tensor([[0, 2, 4, 6], [0, 0, 0, 0], [11, 0, 0, 0], [10, 9, 8, 0]], dtype=torch.int32)
    return BlockTable.packed(bt.to(device)), SeqLens(lens.to(device))


def _close(got, ref, tol=2e-2):
    """Same NaN rows (the caches hold NaN / inf tokens), finite rows close, the same finite LSEs, close."""
    (o, lse), (ro, rl) = got, ref
    o, ro, lse, rl = o.float().cpu(), ro.float().cpu(), lse.cpu(), rl.cpu()
    nan = ro.isnan().any(-1)
    assert torch.equal(o.isnan().any(-1), nan) and torch.equal(lse.isnan(), rl.isnan())
    assert (o[~nan] - ro[~nan]).norm() / max(float(ro[~nan].norm()), 1e-6) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert bool(((lse[fin] - rl[fin]).abs() <= tol * rl[fin].abs().clamp_min(1.0)).all())


@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "k8v4_rot"])
def test_reference_multi_row_decode_is_the_prefill_of_its_rows(name, device):
    """`attention.paged_decode(rows_per_seq=R)` equals `attention.paged_prefill` with `qo_indptr = [0, R, 2R, ...]`
    (every sequence's R new tokens), an empty sequence's rows included, with a window and sinks."""
    desc = filled_cache(name, device, page_buffer=True, seed=3).descriptor(0)
    table, lens = _tables(device)
    r = 3
    q = torch.randn(4 * r, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    sinks = torch.tensor([2.0, -2.0, 0.5, 9.0], device=device)
    qo = torch.tensor([0, 3, 3, 6, 9], dtype=torch.int32)  # the empty sequence has no new tokens in a prefill
    rows = torch.tensor([0, 1, 2, 6, 7, 8, 9, 10, 11])
    for kw in (dict(), dict(window=2, sinks=sinks, softcap=30.0)):
        o, lse = attention.paged_decode(q, desc, table, lens, rows_per_seq=r, **kw)
        po, pl = attention.paged_prefill(q[rows], qo, desc, table, lens, **kw)
        torch.testing.assert_close(o[rows], po, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(lse[rows], pl, rtol=0, atol=0, equal_nan=True)
        assert bool((o[3:6] == 0).all())


@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "k8v4_rot"])
def test_dispatch_multi_row_decode_matches_the_reference(name, device, monkeypatch):
    """`ops.dispatch` on the kernels (checked plan, a sync-free plan with sinks, a bound layer's hot path) agrees
    with the reference attention; the reference path (CPU pools) serves the same plan."""
    desc = filled_cache(name, device, page_buffer=True, seed=3).descriptor(0)
    table, lens = _tables(device)
    r = 3
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4 * r, 4, 64, generator=g).to(torch.bfloat16).to(device)
    s = torch.tensor([2.0, -2.0, 0.5, 9.0], device=device)
    ref = attention.paged_decode(q, desc, table, lens, softcap=20.0, rows_per_seq=r)
    ref_s = attention.paged_decode(q, desc, table, lens, sinks=s, window=4, rows_per_seq=r)
    if device == "cpu":  # the reference path of the plan (CPU pools)
        _close(dispatch.paged_decode(q, desc, table, lens, softcap=20.0, rows_per_seq=r), ref)
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    _close(dispatch.paged_decode(q, desc, table, lens, softcap=20.0, rows_per_seq=r), ref)
    plan = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                q_dtype=q.dtype, device=device, window=4, check=False, max_seq_len=13,
                                rows_per_seq=r)
    assert plan.kernel is not None and plan.kernel.batch == 4 * r
    _close(plan.with_sinks(s).run(q, desc), ref_s)
    fast, none = plan.with_sinks(s).run(q, dispatch.bind(desc), want_lse=False)  # decode + merge only
    assert none is None
    torch.testing.assert_close(fast, plan.with_sinks(s).run(q, desc)[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernels", [False, True])
def test_short_sequences_are_refused_and_nothing_is_written(kernels, device, monkeypatch):
    """A checked plan, the dispatch call and the reference refuse a sequence with fewer cached tokens than rows
    (INVALID_ARGUMENT, naming the sequence), and a wrong number of query rows; the caller's buffers stay as they
    were."""
    if kernels:
        monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    desc = filled_cache("nvfp4", device, page_buffer=True, seed=3).descriptor(0)
    table, lens = _tables(device)  # sequence 2 has 3 tokens
    q = torch.randn(16, 4, 64).to(torch.bfloat16).to(device)
    geo = dict(fmt="nvfp4", num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4, q_dtype=q.dtype,
               device=device)
    for call in (lambda: dispatch.plan_decode(table, lens, rows_per_seq=4, **geo),
                 lambda: dispatch.paged_decode(q, desc, table, lens, rows_per_seq=4),
                 lambda: attention.paged_decode(q, desc, table, lens, rows_per_seq=4)):
        with pytest.raises(KvxError) as e:
            call()
        assert e.value.status == Status.INVALID_ARGUMENT and "sequence 2 has 3 cached tokens" in str(e.value)
    plan = dispatch.plan_decode(table, lens, rows_per_seq=3, **geo)
    out, lse = torch.full((12, 4, 64), 7.0, dtype=q.dtype, device=device), torch.full((12, 4), 7.0, device=device)
    before = desc.k.tensor.clone()
    for bad_q in (q[:8], q):  # 8 or 16 rows for 4 sequences of 3
        with pytest.raises(KvxError) as e:
            plan.run(bad_q, desc, out=out, lse=lse)
        assert e.value.status == Status.INVALID_ARGUMENT
    assert bool((out == 7).all()) and bool((lse == 7).all()) and torch.equal(desc.k.tensor, before)


# ---------------------------------------------------------------- GPU: the CUDA kernel
CUDA_FORMATS = ["nvfp4", "nvfp4_rot", "mxfp4_32", "int4", "int8", "fp8_e4m3", "k8v4", "k8v4_rot"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_FORMATS)
@pytest.mark.parametrize("r", [2, 4])
def test_cuda_multi_row_decode(name, r):
    """The CUDA kernel (forced: no fallback) reads block-table row r // rows_per_seq and each row's length: equal
    to the FP64 oracle on ragged lengths, an empty sequence, GQA 4, softcap + window, sinks."""
    _check(*_run(name, "cuda", [0, 37, r, 300, 1000], r, d=128, backend="cuda"))
    _check(*_run(name, "cuda", [45, 9, 130], r, d=128, backend="cuda", softcap=20.0, window=7, splits=2,
                 sinks=torch.linspace(-3.0, 3.0, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "int8", "k8v4_rot"])
def test_cuda_multi_row_bound_decode_under_a_graph(name):
    """A sync-free plan over a bound layer replays under a CUDA graph: new lengths written into the same tables and
    the plan's row lengths recomputed (same workspace address) give the oracle's attention for the new lengths."""
    from kvx_core.ops.graphs import capture

    device = "cuda"
    desc = filled_cache(name, device, nb=64, bs=16, d=128, page_buffer=True, seed=3).descriptor(0)
    r, nseq = 4, 3
    bt = torch.arange(nseq * 8, dtype=torch.int32, device=device).view(nseq, 8)
    sl = torch.tensor([40, 17, 100], dtype=torch.int32, device=device)
    table, lens = BlockTable.packed(bt), SeqLens(sl)
    q = torch.randn(nseq * r, 4, 128, device=device).to(torch.bfloat16)
    layer = dispatch.bind(desc)
    geo = dict(fmt=name, num_qo_heads=4, num_kv_heads=2, head_dim=128, block_size=16, q_dtype=q.dtype, device=device)
    ws = torch.empty(workspace_size(name, max_batch=nseq, max_seq_len=128, rows_per_seq=r,
                                    **{k: v for k, v in geo.items() if k != "fmt"}), device=device)
    plan = dispatch.plan_decode(table, lens, check=False, max_seq_len=128, workspace=ws, rows_per_seq=r, **geo)
    out = torch.empty_like(q)
    graph, _ = capture(lambda: plan.run(q, layer, out=out, want_lse=False))
    sl.copy_(torch.tensor([9, 128, 4], dtype=torch.int32))
    plan2 = dispatch.plan_decode(table, lens, check=False, max_seq_len=128, workspace=ws, rows_per_seq=r, **geo)
    assert plan2.lens.data_ptr() == plan.lens.data_ptr()
    graph.replay()
    torch.cuda.synchronize()
    _close((out, torch.zeros(nseq * r, 4)), (attention.paged_decode(q, desc, table, lens, rows_per_seq=r)[0],
                                           torch.zeros(nseq * r, 4)))
