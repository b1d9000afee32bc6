"""Attention sinks in the reference paged attention (`ops.attention`) vs float64 textbook attention whose
denominators carry the sink (`oracle.attention_f64(sinks=)`), over every format family, GQA, windows, soft caps,
empty sequences and adversarial sinks; the checks on the sinks tensor; a fuzz test of forged sinks (a checkpoint's
tensor: any dtype, shape and bytes) under the memory cap of `tests/fuzz.py`.

The LSE returned is the log of the whole denominator (sink included); a row without keys gives 0 and the sink."""
import math

import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.ops import dispatch
from kvx_core.ops.attention import attend, paged_decode, paged_prefill

from ..fuzz import run_capped
from .batch import make_batch
from .oracle import attention_f64, dequant_sequence

KV_HEADS = 2
LENS = [0, 1, 17, 40]
FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4_32", "k8v4", "nvfp4_rot", "k8v4_rot"]
SINKS = {  # per query head (GQA 4 over 2 KV heads: 8)
    "mixed": [-1e4, 1e4, 0.0, 2.5, -3.0, 40.0, 0.5, -0.25],
    "zero": [0.0] * 8,
    "drown": [1e4] * 8,  # the sink takes all the mass: output 0, LSE = sink
    "none": [-1e4] * 8,  # no mass: the attention without sinks
    "fp32_edges": [3.4e38, -3.4e38, 1e-45, -1e-45, 88.7, -103.0, 1e30, -1e30],
}


def _assert_attn(out, lse, ref_out, ref_lse, rtol=1e-5):
    out, lse = out.double().numpy(), lse.double().numpy()
    scale = max(1.0, float(np.abs(ref_out).max(initial=0.0)))
    np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=rtol * scale)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_with_sinks_matches_textbook_attention(fmt, sinks):
    """Decode (an empty sequence among them) and prefill, causal with a window and soft cap, and non-causal over
    prefixes of which one is empty (those rows see no key: output 0, LSE = sink)."""
    d = 64
    b = make_batch(fmt, LENS, num_kv_heads=KV_HEADS, head_dim=d, block_size=4, seed=5)
    sk = torch.tensor(SINKS[sinks], dtype=torch.float32)
    hq, scale = 4 * KV_HEADS, 1.0 / math.sqrt(d)
    gen = torch.Generator().manual_seed(9)
    desc = b.cache.descriptor(b.layer)
    kv = [dequant_sequence(b.cache, b.layer, b.blocks[s], n, b.k_global, b.v_global) for s, n in enumerate(LENS)]

    q = 2.0 * torch.randn(len(LENS), hq, d, generator=gen)
    out, lse = paged_decode(q, desc, b.block_table, b.seq_lens, softcap=20.0, sinks=sk)
    ref = [attention_f64(q[s:s + 1].double().numpy(), *kv[s], [n - 1], sm_scale=scale, softcap=20.0,
                         sinks=sk.numpy()) for s, n in enumerate(LENS)]
    _assert_attn(out, lse, np.concatenate([r[0] for r in ref]), np.concatenate([r[1] for r in ref]))
    assert bool((out[0] == 0).all()) and torch.equal(lse[0], sk)  # the empty sequence

    for causal, q_lens, window in ((True, [0, 1, 5, 40], 7), (False, [3, 1, 5, 2], None)):
        qp = 2.0 * torch.randn(sum(q_lens), hq, d, generator=gen)
        ip = np.cumsum([0] + q_lens)
        out, lse = paged_prefill(qp, torch.tensor(ip, dtype=torch.int32), desc, b.block_table, b.seq_lens,
                                 causal=causal, window=window, sinks=sk)
        ref_out, ref_lse = np.zeros((sum(q_lens), hq, d)), np.zeros((sum(q_lens), hq))
        for s, (n, m) in enumerate(zip(LENS, q_lens, strict=True)):
            pos = list(range(n - m, n)) if causal else [n] * m
            ref_out[ip[s]:ip[s + 1]], ref_lse[ip[s]:ip[s + 1]] = attention_f64(
                qp[ip[s]:ip[s + 1]].double().numpy(), *kv[s], pos, sm_scale=scale, window=window, causal=causal,
                sinks=sk.numpy())
        _assert_attn(out, lse, ref_out, ref_lse)
        if not causal:  # sequence 0 caches no token: its 3 queries see no key
            assert bool((out[:3] == 0).all()) and torch.equal(lse[:3], sk.expand(3, -1))


def test_rows_a_window_masks_entirely_give_zero_and_the_sink():
    """The FP64 core: a query whose window holds no key (positions past the keys) gives 0 and LSE = sink; its
    neighbours attend as the textbook says."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    sk = torch.tensor([0.5, -2.0, 7.0, 1e4])
    pos = torch.tensor([2, 5, 40])  # the last sees keys 38..40: none exist
    out, lse = attend(q, k, v, pos, 0.25, None, 2, True, sk)
    ref_out, ref_lse = attention_f64(q.double().numpy(), k.double().numpy(), v.double().numpy(), pos.tolist(),
                                     sm_scale=0.25, window=2, sinks=sk.numpy())
    _assert_attn(out, lse, ref_out, ref_lse, rtol=1e-12)
    assert bool((out[2] == 0).all()) and torch.equal(lse[2], sk.double())


def test_negligible_and_overwhelming_sinks():
    """A sink of -3.4e38 changes nothing (the same bits as no sinks); one of +3.4e38 takes all the mass: output 0
    and LSE = the sink, finite (the join is in the log domain); bf16 sinks are their FP32 values."""
    b = make_batch("nvfp4", [9, 16], num_kv_heads=KV_HEADS, head_dim=64, block_size=4, seed=21)
    q = torch.randn(2, KV_HEADS * 2, 64, generator=torch.Generator().manual_seed(2))
    args = (q, b.cache.descriptor(b.layer), b.block_table, b.seq_lens)
    plain = paged_decode(*args)
    low = paged_decode(*args, sinks=torch.full((4,), -3.4e38))
    assert torch.equal(low[0], plain[0]) and torch.equal(low[1], plain[1])
    high = paged_decode(*args, sinks=torch.full((4,), 3.4e38))
    assert bool((high[0] == 0).all()) and torch.equal(high[1], torch.full((2, 4), 3.4e38))
    s16 = torch.tensor([0.3, -1.7, 2.9, 11.0], dtype=torch.bfloat16)
    a, bb = paged_decode(*args, sinks=s16), paged_decode(*args, sinks=s16.float())
    assert torch.equal(a[0], bb[0]) and torch.equal(a[1], bb[1])


BAD = {
    "a list": ([0.0] * 4, "1-D float tensor"),
    "int32": (torch.zeros(4, dtype=torch.int32), "1-D float tensor"),
    "2-D": (torch.zeros(1, 4), "1-D float tensor"),
    "0-D": (torch.tensor(0.0), "1-D float tensor"),
    "per KV head": (torch.zeros(2), "2 values for 4 query heads"),
    "NaN": (torch.tensor([0.0, float("nan"), 0.0, 0.0]), "finite"),
    "+inf": (torch.tensor([0.0, 0.0, float("inf"), 0.0]), "finite"),
    "-inf": (torch.tensor([float("-inf"), 0.0, 0.0, 0.0]), "finite"),
    "FP64 beyond FP32": (torch.tensor([0.0, 1e300, 0.0, 0.0], dtype=torch.float64), "finite in FP32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_sinks_tensor_is_refused_naming_the_problem(case):
    """Every attention entry point (reference, dispatch, plans, a plan's `with_sinks`) refuses it with
    INVALID_ARGUMENT before anything is computed; a plan's output buffer stays untouched."""
    bad, words = BAD[case]
    b = make_batch("int8", [9, 16], num_kv_heads=KV_HEADS, head_dim=64, block_size=4, seed=1)
    desc, table, lens = b.cache.descriptor(b.layer), b.block_table, b.seq_lens
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0))
    qo = torch.tensor([0, 1, 2], dtype=torch.int32)
    geo = dict(fmt="int8", num_qo_heads=4, num_kv_heads=KV_HEADS, head_dim=64, block_size=4, q_dtype=q.dtype)
    calls = [lambda: paged_decode(q, desc, table, lens, sinks=bad),
             lambda: paged_prefill(q, qo, desc, table, lens, sinks=bad),
             lambda: dispatch.paged_decode(q, desc, table, lens, sinks=bad),
             lambda: dispatch.paged_prefill(q, qo, desc, table, lens, sinks=bad),
             lambda: dispatch.plan_decode(table, lens, sinks=bad, **geo),
             lambda: dispatch.plan_prefill(qo, table, lens, sinks=bad, **geo),
             lambda: dispatch.plan_decode(table, lens, **geo).with_sinks(bad)]
    for call in calls:
        with pytest.raises(KvxError) as e:
            call()
        assert e.value.status == Status.INVALID_ARGUMENT and "sinks" in e.value.message \
            and words in e.value.message, e.value.message
    # a plan with good sinks run on queries of another head count: refused before its output is touched
    plan = dispatch.plan_decode(table, lens, sinks=torch.zeros(4), **geo)
    q8 = torch.randn(2, 8, 64)
    out = torch.full_like(q8, 7.0)
    with pytest.raises(KvxError) as e:
        plan.run(q8, desc, out=out)
    assert e.value.status == Status.INVALID_ARGUMENT and "sinks has 4 values for 8 query heads" in e.value.message
    assert bool((out == 7.0).all())


# ---------------------------------------------------------------- fuzz: forged sinks tensors
def forged_sinks(rng):
    """A sinks tensor for 4 query heads forged as a checkpoint could hold it: a valid one's bytes with flipped
    sign / exponent / mantissa bits (NaN, inf, huge, subnormal) or `mutate_bytes` damage (a wrong length), viewed
    as a random dtype and sometimes 2-D; or, rarely, None or a non-tensor."""
    from ..fuzz import mutate_bytes

    if rng.random() < 0.05:
        return rng.choice([None, [0.0] * 4, 1.5, "sinks", np.zeros(4)])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16, torch.float64,
                        torch.int32, torch.float8_e4m3fn])
    raw = bytearray(torch.tensor([0.5, -2.0, 9.0, 300.0]).to(dtype).view(torch.uint8).numpy().tobytes())
    if rng.random() < 0.7:
        for _ in range(rng.randint(1, 6)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    else:
        raw = mutate_bytes(bytes(raw), rng)
    raw = raw[:len(raw) - len(raw) % dtype.itemsize] or bytes(dtype.itemsize)
    sinks = torch.frombuffer(bytearray(raw), dtype=dtype)
    return sinks.view(2, -1) if rng.random() < 0.1 and sinks.numel() % 2 == 0 else sinks


def check_accepted(sinks, out: torch.Tensor, lse: torch.Tensor) -> None:
    """What accepted sinks guarantee over finite K/V: finite outputs; with sinks, finite LSEs of at least the sink
    (its term is in every denominator; without sinks an empty sequence's LSE is -inf)."""
    ok = bool(torch.isfinite(out).all())
    if sinks is not None:
        ok = ok and bool(torch.isfinite(lse).all()) and bool((lse.cpu() >= sinks.float()).all())
    assert ok, (sinks, out, lse)


_FUZZ: dict = {}


def sinks_target(rng) -> None:
    """Under the fuzz harness: `forged_sinks` into the reference decode and prefill and a plan: only KvxError may
    escape, and accepted sinks give what `check_accepted` states."""
    if not _FUZZ:
        b = make_batch("nvfp4", [0, 5, 9], num_kv_heads=KV_HEADS, head_dim=32, block_size=4, seed=4)
        _FUZZ.update(desc=b.cache.descriptor(b.layer), table=b.block_table, lens=b.seq_lens,
                     q=torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1)))
    f = _FUZZ
    sinks = forged_sinks(rng)
    check_accepted(sinks, *paged_decode(f["q"], f["desc"], f["table"], f["lens"], sinks=sinks))
    qo = torch.tensor([0, 0, 1, 3], dtype=torch.int32)
    check_accepted(sinks, *paged_prefill(f["q"], qo, f["desc"], f["table"], f["lens"], sinks=sinks))
    plan = dispatch.plan_decode(f["table"], f["lens"], fmt="nvfp4", num_qo_heads=4, num_kv_heads=KV_HEADS,
                                head_dim=32, block_size=4, q_dtype=torch.float32, sinks=sinks)
    check_accepted(sinks, *plan.run(f["q"], f["desc"]))


def test_fuzz_forged_sinks():
    run_capped("tests.cache.test_sinks:sinks_target", cases=300)
