"""The TGI backend's hot path runs on each cache's bound layer (`KVCache.layer`, `dispatch.bind`): `store` writes
through it and decode runs over it, with the kernels forced on CPU under the interpreter (as on CUDA). What it
stores equals the torch reference's write into a cache given the same scales and key vectors directly (bit for bit,
also after checkpoint scales or a calibration changed them: the layer is bound again), and its decode equals the
descriptor's (bit for bit) and the reference attention. No server: the cache and attention functions are called
as TGI's model files call them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.formats import get_format
from kvx_core.kv_calibration import LayerValues
from kvx_core.ops import attention as kvx_attention, decode as decode_ops, dispatch, reference
from kvx_tgi import attention, calibration, config
from kvx_tgi.kv_cache import KVCache, KVScales

BLOCKS, BS, H, D, HQ = 6, 16, 2, 64, 4
ONE = torch.tensor(1.0)


@pytest.fixture
def kernels(monkeypatch):
    """The KVX kernels on CPU pools, plans sync-free as on CUDA, and a spy on the bound fast paths (which still
    run): `calls` names each bound write / decode."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    monkeypatch.setattr(attention, "_sync_free", lambda device: True)
    monkeypatch.setattr(attention, "_step", None)
    calls: list[str] = []
    write, decode = dispatch._write_bound, decode_ops.DecodePlan.run_bound
    monkeypatch.setattr(dispatch, "_write_bound", lambda *a, **k: calls.append("write") or write(*a, **k))
    monkeypatch.setattr(decode_ops.DecodePlan, "run_bound", lambda *a, **k: calls.append("decode") or decode(*a, **k))
    return calls


def _cache(fmt: str, monkeypatch, per_head: bool = False) -> KVCache:
    monkeypatch.setattr(config, "_current", config.RunConfig(get_format(fmt), "flashdecoding", BS, None))
    monkeypatch.setattr(calibration, "_loaded", {"a file": []} if per_head else {})  # active(): per-head scales
    return KVCache(num_blocks=BLOCKS, num_heads=H, head_size=D, dtype=torch.bfloat16, device=torch.device("cpu"))


def _oracle(fmt: str, k_global=None, v_global=None, smoothing=None, center=None, per_head=False) -> PagedKVCache:
    """A cache given the expected scales and key vectors through its own setters."""
    c = PagedKVCache(fmt, num_layers=1, num_blocks=BLOCKS, block_size=BS, num_kv_heads=H, head_dim=D,
                     per_head_global_scale=per_head)
    if k_global is not None:
        c.set_global_scales(0, k_global, v_global)
    c.set_key_smoothing(0, smoothing)
    c.set_key_center(0, center)
    return c


def _tokens(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, H, D, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    return k, v, torch.randperm(BLOCKS * BS, generator=g)[:n].to(torch.int64)


def _same_pools(a: PagedKVCache, b: PagedKVCache) -> bool:
    pa, pb = a.layers[0], b.layers[0]
    return all(torch.equal(getattr(pa, n).view(torch.uint8), getattr(pb, n).view(torch.uint8))
               for n in ("k_data", "v_data", "k_scales", "v_scales") if getattr(pa, n) is not None)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "k8v4_rot", "bf16"])
def test_store_writes_through_the_bound_layer(fmt, kernels, monkeypatch):
    kv = _cache(fmt, monkeypatch)
    assert isinstance(kv.layer, dispatch.BoundLayer) and kv.layer.cache is kv.desc
    k, v, slots = _tokens(40)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(ONE, ONE))
    want = _oracle(fmt)
    reference.write_kv(want.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    assert kernels == ["write"] and _same_pools(kv.cache, want)


@pytest.mark.parametrize("fmt, rng", [("nvfp4", 6 * 448), ("fp8_e4m3", 448)])
def test_checkpoint_scales_bind_the_layer_again(fmt, rng, kernels, monkeypatch):
    """The scales arrive with the first store, after the cache was bound: a per-tensor scale is expanded to every
    KV head (a copy) when bound, so writes under the stale binding would encode with 1.0. Expected global scale:
    amax / range in FP32, amax = k_scale * 448 (the FP8 convention of checkpoint scales)."""
    kv = _cache(fmt, monkeypatch)
    first = kv.layer
    k, v, slots = _tokens(40, seed=1)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(torch.tensor(0.05), torch.tensor(0.02)))
    assert kv.layer is not first and kv.layer.cache is kv.desc and kernels == ["write"]
    want = _oracle(fmt, torch.tensor(0.05) * 448 / rng, torch.tensor(0.02) * 448 / rng)
    reference.write_kv(want.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    assert _same_pools(kv.cache, want)


@pytest.mark.parametrize("center", [False, True])
def test_calibration_binds_the_layer_again(center, kernels, monkeypatch):
    kv = _cache("nvfp4", monkeypatch, per_head=True)
    g = torch.Generator().manual_seed(3)
    s = torch.rand(H, D, generator=g) * 3.75 + 0.25
    c = torch.rand(H, D, generator=g) * 4 - 2 if center else None
    kg, vg = torch.rand(H, generator=g) * 0.01 + 0.001, torch.rand(H, generator=g) * 0.01 + 0.001
    k, v, slots = _tokens(40, seed=2)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(ONE, ONE, LayerValues(s, c, kg, vg)))
    assert kv.layer.cache is kv.desc and torch.equal(kv.layer.k_smoothing, s) and kernels == ["write"]
    want = _oracle("nvfp4", kg, vg, s, c, per_head=True)
    reference.write_kv(want.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    assert _same_pools(kv.cache, want)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "k8v4_rot"])
def test_decode_runs_on_the_bound_layer(fmt, kernels, monkeypatch):
    kv = _cache(fmt, monkeypatch)
    k, v, slots = _tokens(BLOCKS * BS, seed=4)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(ONE, ONE))
    kernels.clear()
    block_tables = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    seqlen = SimpleNamespace(input_lengths=torch.tensor([1, 1], dtype=torch.int32),
                             cache_lengths=torch.tensor([40, 17], dtype=torch.int32))
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = attention.paged_attention(q, kv, None, D ** -0.5, block_tables, seqlen, 48, kv_scales=KVScales(ONE, ONE))
    assert kernels == ["decode"]
    table, lens = BlockTable.packed(block_tables), SeqLens(torch.tensor([41, 18], dtype=torch.int32))
    plan = dispatch.plan_decode(table, lens, fmt=fmt, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS,
                                q_dtype=torch.bfloat16, device="cpu", max_seq_len=48, sm_scale=D ** -0.5, check=False)
    want, _ = plan.run(q, kv.desc, want_lse=False)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref, _ = kvx_attention.paged_decode(q, kv.desc, table, lens, sm_scale=D ** -0.5)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_prefill_over_the_bound_layer_runs_on_its_descriptor(kernels, monkeypatch):
    """Prefill has no bound fast path: the plan runs over the descriptor the layer was bound from."""
    kv = _cache("nvfp4", monkeypatch)
    k, v, slots = _tokens(BLOCKS * BS, seed=6)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(ONE, ONE))
    block_tables = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    seqlen = SimpleNamespace(input_lengths=torch.tensor([3, 2], dtype=torch.int32),
                             cache_lengths=torch.tensor([30, 10], dtype=torch.int32),
                             cu_seqlen_q=torch.tensor([0, 3, 5], dtype=torch.int32))
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = attention.attention(query=q, key=None, value=None, kv_cache=kv, kv_scales=KVScales(ONE, ONE),
                              seqlen=seqlen, block_tables=block_tables, softmax_scale=D ** -0.5)
    table, lens = BlockTable.packed(block_tables), SeqLens(torch.tensor([33, 12], dtype=torch.int32))
    ref, _ = kvx_attention.paged_prefill(q, seqlen.cu_seqlen_q, kv.desc, table, lens, sm_scale=D ** -0.5)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_prefill_splits_by_tgis_longest_length(kernels, monkeypatch):
    """TGI's `Seqlen.max_k` (its batch's longest cache + input length) sizes the prefill's key splits, as vLLM's
    `max_seq_len` does: 4 new queries over a 2k-token cached prefix split (on the interpreter's 4 stand-in SMs) and
    give the unsplit plan's output (same kernel, keys merged by log-sum-exp: FP32 rounding apart) and the
    reference's; a Seqlen without `max_k` plans the unsplit kernel."""
    monkeypatch.setattr(config, "_current", config.RunConfig(get_format("nvfp4"), "flashdecoding", BS, None))
    monkeypatch.setattr(calibration, "_loaded", {})
    n, new = 2048 + 4 * BS, 4
    kv = KVCache(num_blocks=n // BS, num_heads=H, head_size=D, dtype=torch.bfloat16, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(8)
    k = (torch.randn(n, H, D, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    kv.store(key=k, value=v, slots=torch.arange(n), kv_scales=KVScales(ONE, ONE))
    block_tables = torch.arange(n // BS, dtype=torch.int32)[None]
    q = torch.randn(new, HQ, D, generator=g).to(torch.bfloat16)

    def prefill(**max_k):
        monkeypatch.setattr(attention, "_step", None)
        seqlen = SimpleNamespace(input_lengths=torch.tensor([new], dtype=torch.int32),
                                 cache_lengths=torch.tensor([n - new], dtype=torch.int32),
                                 cu_seqlen_q=torch.tensor([0, new], dtype=torch.int32), **max_k)
        out = attention.attention(query=q, key=None, value=None, kv_cache=kv, kv_scales=KVScales(ONE, ONE),
                                  seqlen=seqlen, block_tables=block_tables, softmax_scale=D ** -0.5)
        return out.float(), attention._step.plan.kernel.num_splits

    split, splits = prefill(max_k=n)
    whole, one = prefill()
    assert splits > 1 and one == 1
    assert (split - whole).abs().max() <= 2 ** -7 * whole.abs().max()  # BF16 outputs: a rounding step apart
    ref, _ = kvx_attention.paged_prefill(q, torch.tensor([0, new]), kv.desc, BlockTable.packed(block_tables),
                                         SeqLens(torch.tensor([n], dtype=torch.int32)), sm_scale=D ** -0.5)
    assert (split - ref.float()).norm() / ref.float().norm() < 2e-2


def test_without_the_kernels_the_layer_is_the_descriptor(monkeypatch):
    """CPU pools (no kernel device): nothing to bind, the reference serves the descriptor."""
    kv = _cache("nvfp4", monkeypatch)
    assert kv.layer is kv.desc
    k, v, slots = _tokens(8, seed=8)
    kv.store(key=k, value=v, slots=slots, kv_scales=KVScales(torch.tensor(0.05), torch.tensor(0.02)))
    assert kv.layer is kv.desc
