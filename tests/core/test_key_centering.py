"""Per-channel key centering (`ops.smoothing`, `QuantDesc.k_center`): the calibration rule (the mean); a centered
cache stores exactly what a plain cache stores for `(K - c) / s` (composition oracle) and reads back
`decode * s + c`; attention over it (output and LSE) equals attention over the keys it reads back, although the
kernels see `q . (k - c)`; a soft cap is refused; bad vectors are refused and change nothing. The kernel paths:
tests/kernels/test_key_smoothing_kernels.py."""
from __future__ import annotations

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.calibration import SampleObserver, key_center, stored_values
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch

H, D, NB, BS = 2, 32, 6, 4


def _kv(seed: int):
    g = torch.Generator().manual_seed(seed)
    offset = torch.zeros(H, D)
    offset[:, ::7] = torch.randn(H, (D + 6) // 7, generator=g) * 20  # channels that sit far from 0 in every token
    k = torch.randn(NB * BS, H, D, generator=g) * torch.logspace(-1, 1, D) + offset
    return k.bfloat16(), torch.randn(NB * BS, H, D, generator=g).bfloat16(), offset


def _cache(fmt: str, c: torch.Tensor | None, s: torch.Tensor | None = None) -> PagedKVCache:
    cache = PagedKVCache(fmt, num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D)
    cache.set_key_center(0, c)
    cache.set_key_smoothing(0, s)
    return cache


def _all(c: PagedKVCache):
    table = torch.arange(NB, dtype=torch.int32).view(1, NB)
    return c.gather(0, table, torch.tensor([NB * BS], dtype=torch.int32), out_dtype=torch.float32)


def test_rule_is_the_mean_per_head_and_channel():
    keys = torch.tensor([[[1.0, -2.0]], [[3.0, 2.0]], [[5.0, 6.0]]])  # [T=3, H=1, D=2]
    assert torch.equal(key_center(keys), torch.tensor([[3.0, 2.0]]))
    assert key_center(keys.bfloat16()).dtype == torch.float32
    for bad in (torch.ones(0, 1, 2), torch.full((2, 1, 2), float("nan")), torch.ones(2, 2),
                torch.ones(2, 1, 2, dtype=torch.int32)):
        with pytest.raises(KvxError):
            key_center(bad)
    obs = SampleObserver(1)
    obs.observe(0, keys, keys)
    k, v = stored_values(obs, [torch.full((1, 2), 2.0)], center=[torch.tensor([[3.0, 2.0]])]).values(0)
    assert torch.equal(k, (keys - torch.tensor([[3.0, 2.0]])) / 2) and torch.equal(v, keys)  # (K - c) / s


@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_rot", "fp8_e4m3", "int4", "k8v4", "mxfp4_rot", "int8"])
def test_centered_cache_is_the_plain_cache_of_k_minus_c(fmt, smoothed):
    k, v, offset = _kv(1)
    c = key_center(k.float())
    s = torch.rand(H, D, generator=torch.Generator().manual_seed(2)) * 3 + 0.3 if smoothed else None
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(3))
    centered, plain = _cache(fmt, c, s), _cache(fmt, None)
    centered.write(0, k, v, slots)
    stored = k.float() - c
    plain.write(0, (stored if s is None else stored / s).bfloat16(), v, slots)  # what the centered cache must store
    for name in ("k_data", "v_data", "k_scales", "v_scales", "k_global", "v_global"):
        a, b = getattr(centered.layers[0], name), getattr(plain.layers[0], name)
        assert (a is None and b is None) or torch.equal(a, b), name
    (kc, vc), (kp, vp) = _all(centered), _all(plain)
    assert torch.equal(kc, (kp if s is None else kp * s) + c) and torch.equal(vc, vp)
    err_c = float((kc[slots] - k.float()).norm())
    assert err_c < 0.5 * float((kc[slots] - stored).norm())  # reads back K, not K - c
    if s is None:  # and, the offsets gone, closer to K than the plain cache of K (a random s may undo it)
        plain_k = _cache(fmt, None)
        plain_k.write(0, k, v, slots)
        assert err_c < float((_all(plain_k)[0][slots] - k.float()).norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_rot", "fp8_e4m3"])
def test_attention_and_lse_over_a_centered_cache_are_those_over_the_keys_it_reads_back(fmt):
    k, v, _ = _kv(4)
    c = _cache(fmt, key_center(k.float()), torch.rand(H, D, generator=torch.Generator().manual_seed(5)) + 0.5)
    c.write(0, k, v, torch.arange(NB * BS))
    kk, vv = _all(c)
    q = torch.randn(3, 2 * H, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    table = BlockTable.packed(torch.arange(NB, dtype=torch.int32).view(1, NB).repeat(3, 1))
    lens = SeqLens(torch.tensor([NB * BS, 5, 17], dtype=torch.int32))
    o, lse = dispatch.paged_decode(q, c.descriptor(0), table, lens)
    plan = dispatch.plan_decode(table, lens, fmt=fmt, num_qo_heads=2 * H, num_kv_heads=H, head_dim=D, block_size=BS,
                                q_dtype=q.dtype)
    assert plan.run(q, c.descriptor(0), want_lse=False)[1] is None
    with pytest.raises(KvxError):  # a buffer for an LSE the caller says it does not want
        plan.run(q, c.descriptor(0), lse=torch.empty(3, 2 * H), want_lse=False)
    for b, n in enumerate((NB * BS, 5, 17)):
        kq, vq = kk[:n].double().repeat_interleave(2, dim=1), vv[:n].double().repeat_interleave(2, dim=1)
        logits = torch.einsum("hd,thd->ht", q[b].double(), kq) / D ** 0.5
        ref = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), vq)
        assert bool(((o[b].double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all())  # the bf16 output's rounding
        assert float((lse[b].double() - torch.logsumexp(logits, dim=-1)).abs().max()) < 1e-4


def test_soft_cap_is_refused_with_centering():
    k, v, _ = _kv(7)
    c = _cache("nvfp4", key_center(k.float()))
    c.write(0, k, v, torch.arange(NB * BS))
    q = torch.randn(1, 2 * H, D).bfloat16()
    table = BlockTable.packed(torch.arange(NB, dtype=torch.int32).view(1, NB))
    lens = SeqLens(torch.tensor([NB * BS], dtype=torch.int32))
    for run in (dispatch.paged_decode, attention.paged_decode):
        with pytest.raises(KvxError) as e:
            run(q, c.descriptor(0), table, lens, softcap=30.0)
        assert e.value.status == Status.UNSUPPORTED and "shift invariant" in str(e.value)
    assert dispatch.paged_decode(q, _cache("nvfp4", None).descriptor(0), table, lens, softcap=30.0)[0].shape == q.shape


def test_refusals_change_nothing():
    with pytest.raises(KvxError) as e:
        _cache("bf16", torch.zeros(H, D))
    assert e.value.status == Status.INVALID_ARGUMENT
    c = _cache("nvfp4", None)
    for bad in (torch.ones(H, D + 1), torch.full((H, D), float("inf")), torch.full((H, D), float("nan")), [0.0] * D):
        with pytest.raises(KvxError):
            c.set_key_center(0, bad)
        assert c.layers[0].k_center is None
    c.set_key_center(0, -torch.ones(H, D))  # any finite value: negative and zero channels are valid centers
    assert torch.equal(c.descriptor(0).quant.k_center, -torch.ones(H, D))
    c.set_key_center(0, None)
    assert c.descriptor(0).quant.k_center is None
