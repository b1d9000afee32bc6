"""Per-channel key smoothing (`ops.smoothing`, `QuantDesc.k_smoothing`): the calibration rule against hand values;
a smoothed cache stores exactly what an unsmoothed cache stores for `K / s` (composition oracle) and reads back
`decode * s`; attention over it equals attention over the keys it reads back; refusals (plain formats, bad vectors)
change nothing; the C ABI (v1.2) carries it with its flag, and (v1.3) key centering `k_center` beside it. KV bundles
carry both: tests/transfer/test_bundle_smoothing.py."""
from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from kvx_core.abi import center_of, smoothing_of
from kvx_core.cache import PagedKVCache
from kvx_core.calibration import key_smoothing
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.enums import QUANT_FLAG_KEY_CENTERING, QUANT_FLAG_KEY_SMOOTHING
from kvx_core.errors import KvxError, Status
from kvx_core.ops import dispatch

H, D, NB, BS = 2, 32, 6, 4


def test_rule_against_hand_values():
    keys = torch.ones(3, 1, 4)
    keys[1, 0] = torch.tensor([-4.0, 1.0, 0.5, 1.0])  # channel amax 4, 1, 1, 1
    g = 4.0 ** 0.25
    assert torch.allclose(key_smoothing(keys, 1.0)[0], torch.tensor([4 / g, 1 / g, 1 / g, 1 / g]))
    assert torch.allclose(key_smoothing(keys, 0.5)[0], torch.tensor([4 / g, 1 / g, 1 / g, 1 / g]) ** 0.5)
    assert torch.equal(key_smoothing(keys, 0.0), torch.ones(1, 4))
    zero = keys.clone()
    zero[:, 0, 3] = 0.0  # an all-zero channel: floored at 2**-20 of the head's max, finite and > 0
    s = key_smoothing(zero, 1.0)
    assert bool(torch.isfinite(s).all() and (s > 0).all()) and float(s[0, 3]) < 1e-4
    for bad in (torch.zeros(2, 1, 4), torch.full((2, 1, 4), float("nan")), torch.ones(0, 1, 4)):
        with pytest.raises(KvxError):
            key_smoothing(bad)
    with pytest.raises(KvxError):
        key_smoothing(keys, 1.5)


def _cache(fmt: str, s: torch.Tensor | None) -> PagedKVCache:
    c = PagedKVCache(fmt, num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D)
    c.set_key_smoothing(0, s)
    return c


def _kv(seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB * BS, H, D, generator=g) * torch.logspace(-1, 1.5, D)  # outlier channels
    return k.bfloat16(), torch.randn(NB * BS, H, D, generator=g).bfloat16()


def _smoothing(seed: int) -> torch.Tensor:
    return torch.rand(H, D, generator=torch.Generator().manual_seed(seed)) * 4 + 0.25


def _all(c: PagedKVCache):
    table = torch.arange(NB, dtype=torch.int32).view(1, NB)
    return c.gather(0, table, torch.tensor([NB * BS], dtype=torch.int32), out_dtype=torch.float32)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_rot", "fp8_e4m3", "int4", "k8v4", "mxfp4"])
def test_smoothed_cache_is_the_plain_cache_of_k_over_s(fmt):
    k, v = _kv(1)
    s = _smoothing(2)
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(3))
    smoothed, plain = _cache(fmt, s), _cache(fmt, None)
    smoothed.write(0, k, v, slots)
    plain.write(0, (k.float() / s).bfloat16(), v, slots)  # what the smoothed cache must store
    for name in ("k_data", "v_data", "k_scales", "v_scales", "k_global", "v_global"):
        a, b = getattr(smoothed.layers[0], name), getattr(plain.layers[0], name)
        assert (a is None and b is None) or torch.equal(a, b), name
    (ks, vs), (kp, vp) = _all(smoothed), _all(plain)
    assert torch.equal(ks, kp * s) and torch.equal(vs, vp)
    rel = float((ks[slots] - k.float()).norm() / k.float().norm())  # reads back the keys, not K / s
    assert rel < 0.35 < float((ks[slots] - k.float() / s).norm() / k.float().norm())


def test_attention_over_a_smoothed_cache_is_attention_over_the_keys_it_reads_back():
    k, v = _kv(4)
    s = _smoothing(5)
    c = _cache("nvfp4", s)
    c.write(0, k, v, torch.arange(NB * BS))
    kk, vv = _all(c)
    q = torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    table = BlockTable.packed(torch.arange(NB, dtype=torch.int32).view(1, NB))
    o, _ = dispatch.paged_decode(q, c.descriptor(0), table, SeqLens(torch.tensor([NB * BS], dtype=torch.int32)))
    kq = kk.double().repeat_interleave(2, dim=1)  # GQA: query heads 0, 1 read KV head 0
    p = torch.softmax(torch.einsum("hd,thd->ht", q[0].double(), kq) / D ** 0.5, dim=-1)
    ref = torch.einsum("ht,thd->hd", p, vv.double().repeat_interleave(2, dim=1))
    assert float((o[0].double() - ref).abs().max()) < 2e-2


def test_refusals_change_nothing(tmp_path):
    with pytest.raises(KvxError) as e:
        _cache("bf16", _smoothing(1))
    assert e.value.status == Status.INVALID_ARGUMENT
    c = _cache("nvfp4", None)
    for bad in (torch.ones(H, D + 1), torch.zeros(H, D), torch.full((H, D), float("inf")), -torch.ones(H, D)):
        with pytest.raises(KvxError):
            c.set_key_smoothing(0, bad)
        assert c.layers[0].k_smoothing is None
    c.set_key_smoothing(0, _smoothing(1))
    q = c.descriptor(0).quant  # C ABI v1.2: the vector's address with KVX_QUANT_FLAG_KEY_SMOOTHING
    qc = q.to_ctypes()
    assert qc.flags == q.flags | QUANT_FLAG_KEY_SMOOTHING
    assert ctypes.addressof(smoothing_of(qc).contents) == q.k_smoothing.data_ptr()
    for bad in (q.k_smoothing.t(), q.k_smoothing.double()):  # the C side reads contiguous FP32 rows
        with pytest.raises(KvxError) as e:
            replace(q, k_smoothing=bad).to_ctypes()
        assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError):  # the flag follows the vector; set by hand it is refused
        replace(q, flags=q.flags | QUANT_FLAG_KEY_SMOOTHING).to_ctypes()


@pytest.mark.parametrize("smoothed", [False, True], ids=["center", "center_and_smoothing"])
def test_c_abi_v1_3_carries_the_key_center(smoothed):
    """`to_ctypes` sets `k_center` and KVX_QUANT_FLAG_KEY_CENTERING together (and the smoothing beside them), with
    the checks smoothing has: contiguous FP32 rows, the flag never set by hand."""
    c = _cache("nvfp4", _smoothing(1) if smoothed else None)
    c.set_key_center(0, torch.randn(H, D, generator=torch.Generator().manual_seed(5)))
    q = c.descriptor(0).quant
    qc = q.to_ctypes()
    assert qc.flags == q.flags | QUANT_FLAG_KEY_CENTERING | (QUANT_FLAG_KEY_SMOOTHING if smoothed else 0)
    assert ctypes.addressof(center_of(qc).contents) == q.k_center.data_ptr()
    assert (smoothing_of(qc) is not None) == smoothed
    for bad in (q.k_center.t(), q.k_center.double()):
        with pytest.raises(KvxError) as e:
            replace(q, k_center=bad).to_ctypes()
        assert e.value.status == Status.INVALID_ARGUMENT and "k_center" in str(e.value)
    with pytest.raises(KvxError) as e:
        replace(q, flags=q.flags | QUANT_FLAG_KEY_CENTERING).to_ctypes()
    assert "KVX_QUANT_FLAG_KEY_CENTERING" in str(e.value)
    assert center_of(replace(q, k_center=None).to_ctypes()) is None
