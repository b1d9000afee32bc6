"""TGI's real model server (FlashCausalLM + FlashLlamaForCausalLM + TextGenerationService) with KVX caches,
driven over gRPC on a unix socket as TGI's router drives it (tests/tgi/harness.py), ATTENTION=flashdecoding
(BLOCK_SIZE 256, chunked prefill, prefix caching), on CPU (SYSTEM=cpu: torch rotary/norms of kvx_tgi) or CUDA.

What is asserted, per KVX format (SmolLM2-135M, bf16 weights, 512 tokens of the demo text):
- warmup: the cache holds exactly `KVX_KV_CACHE_MEMORY // (layers * 256 * kv_heads * bytes_per_token_head)`
  blocks (TGI's `max_supported_total_tokens`), i.e. the format's real bytes per token;
- chunked prefill (4 x 128 tokens, each chunk reading the previous ones from the cache): the teacher-forced
  perplexity from TGI's prefill logprobs is within `checks.PPL_BOUND` of the BF16 run;
- every layer's cache, gathered back through KVX from the request's blocks, equals the format's encode ->
  decode of the K/V that TGI handed to `KVCache.store` for those tokens (exact);
and for bf16: greedy generation equals transformers (bf16) token for token, up to the first near-tie.
"""
from __future__ import annotations

import gc
import json
import os
from contextlib import contextmanager

import pytest
import torch

from kvx_core.formats import get_format
from kvx_tgi.config import format_names, parse_bytes

from .checks import PPL_BOUND, StoreSpy, cache_mismatches, expected_blocks, perplexity
from .harness import InProcessServer, Router, wait_for_socket

GRAPHS = torch.cuda.is_available() and bool(os.environ.get("CUDA_GRAPHS"))
"""TGI replays decode steps from CUDA graphs (no Python runs, so the store() spy sees prompt tokens only)."""
BLOCK = 256
CHUNK = 128
PROMPT = 512


@contextmanager
def serving(model_dir: str, fmt: str, tmp_path, spy: StoreSpy | None = None, monkeypatch=None):
    """A warmed-up in-process server for `fmt` and its router; the spy (if any) records every store()."""
    import kvx_tgi.kv_cache as kvc

    if spy is not None:
        monkeypatch.setattr(kvc.KVCache, "store", spy.wrap(kvc.KVCache.store))
    srv = InProcessServer(model_dir, str(tmp_path / f"tgi-{fmt}"), fmt)
    try:
        router = Router(wait_for_socket(srv.url), BLOCK)
        router.warmup([router.warmup_request("KVX warmup", 4)], max_total_tokens=2048, max_prefill_tokens=CHUNK)
        yield srv, router
    finally:
        srv.close()
        del srv
        gc.collect()


@pytest.fixture(scope="module")
def demo_ids(smol_dir):
    """The first 512 tokens of the demo text (and the text that tokenizes back to exactly them)."""
    from transformers import AutoTokenizer

    from kvx_demo.text import default_text

    tok = AutoTokenizer.from_pretrained(smol_dir)
    ids = tok(default_text(), add_special_tokens=False).input_ids[:PROMPT]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    return tok, ids, text


def chunked_prefill(router: Router, text: str, n: int, max_new_tokens: int = 2):
    """One request prefilled in chunks of CHUNK (TGI continues a prefilling batch on Decode), then decoded."""
    req, seq = router.request(text, max_new_tokens=max_new_tokens, prompt_len=n, prefill_logprobs=True,
                              chunk_len=CHUNK)
    batch = router.prefill([req])
    calls = 1
    while batch is not None and not seq.tokens:
        batch = router.decode([batch])
        calls += 1
    assert calls == -(-n // CHUNK), f"expected {-(-n // CHUNK)} prefill chunks, TGI ran {calls}"
    router.run_to_end(batch)
    return seq


@pytest.fixture(scope="module")
def bf16_ppl(smol_dir, demo_ids, tmp_path_factory):
    _, ids, text = demo_ids
    with serving(smol_dir, "bf16", tmp_path_factory.mktemp("bf16")) as (_, router):
        seq = chunked_prefill(router, text, len(ids))
    assert seq.prompt_ids == ids
    return perplexity(seq.prompt_logprobs)


@pytest.mark.parametrize("fmt", format_names())
def test_format_serves_chunked_prefill(fmt, smol_dir, demo_ids, bf16_ppl, tmp_path, monkeypatch):
    _, ids, text = demo_ids
    spy = StoreSpy()
    with serving(smol_dir, fmt, tmp_path, spy, monkeypatch) as (srv, router):
        model = srv.model
        cap = parse_bytes(os.environ["KVX_KV_CACHE_MEMORY"])
        want = expected_blocks(get_format(fmt), cap, model.num_layers, BLOCK, model.num_kv_heads, model.head_size)
        assert router.num_blocks == want, f"{fmt}: warmup gave {router.num_blocks} blocks, the format holds {want}"
        seq = chunked_prefill(router, text, len(ids))
        assert seq.prompt_ids == ids and len(seq.tokens) == 2
        assert cache_mismatches(model.kv_cache, spy, seq.blocks, len(ids) + 1, required=len(ids)) == []
    ppl = perplexity(seq.prompt_logprobs)
    if os.environ.get("KVX_TGI_RESULTS"):  # one JSON line per format, for benchmarks/results
        with open(os.environ["KVX_TGI_RESULTS"], "a") as f:
            f.write(json.dumps({"format": fmt, "device": str(model.device), "cache_bytes": cap, "blocks": want,
                                "block_size": BLOCK, "perplexity": round(ppl, 4), "bf16_perplexity": round(bf16_ppl, 4),
                                "tokens": len(ids), "chunk": CHUNK}) + "\n")
    assert ppl <= bf16_ppl * (1 + PPL_BOUND[fmt]) + 1e-9, f"{fmt}: perplexity {ppl:.3f} vs bf16 {bf16_ppl:.3f}"
    if fmt == "bf16":
        assert bf16_ppl == pytest.approx(17.54, rel=0.01)  # the demo's float32 reference over these tokens: 17.5395


def test_negative_control_shifted_slots_are_caught(smol_dir, demo_ids, tmp_path, monkeypatch):
    """A slot mapping shifted by one token (what an off-by-one in the TGI translation would do) must make the
    cache check fail: the check above can fail."""
    import kvx_tgi.kv_cache as kvc
    from kvx_core.descriptors import SlotMapping

    tok, ids, _ = demo_ids
    monkeypatch.setattr(kvc, "slots_from_tgi", lambda s: SlotMapping(s + 1, invalid_slot=-1))
    spy = StoreSpy()
    with serving(smol_dir, "int8", tmp_path, spy, monkeypatch) as (srv, router):
        seq = chunked_prefill(router, tok.decode(ids[:CHUNK]), CHUNK)
        assert cache_mismatches(srv.model.kv_cache, spy, seq.blocks, 128)


def _hf_greedy(model_dir: str, prompts: list[str], n: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    out = []
    for p in prompts:
        ids = tok(p, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in g.scores]
        out.append((ids.shape[1], g.sequences[0, ids.shape[1]:].tolist(), gaps))
    return out


PROMPTS = ["The capital of France is", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           "In 1905, Albert Einstein published four papers that"]
NEAR_TIE = 1 / 16
"""Top-2 logit gap (transformers, bf16) below which TGI may legitimately pick the other token: one bf16 ulp at
logit magnitudes 8-16; comparison of a sequence stops at its first such position."""


def test_bf16_batched_greedy_equals_transformers(smol_dir, tmp_path):
    n = 24
    ref = _hf_greedy(smol_dir, PROMPTS, n)
    with serving(smol_dir, "bf16", tmp_path) as (_, router):
        reqs, seqs = zip(*(router.request(p, max_new_tokens=n, prompt_len=k)
                           for p, (k, _, _) in zip(PROMPTS, ref, strict=True)), strict=True)
        router.run_to_end(router.prefill(list(reqs)))
    compared = 0
    for seq, (_, want, gaps) in zip(seqs, ref, strict=True):
        stop = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), n)
        assert seq.tokens[:stop] == want[:stop], f"{seq.text!r}: {seq.tokens} vs transformers {want}"
        compared += stop
    assert compared >= 30, f"only {compared} tokens compared before near-ties"


def test_prefix_reuse_and_join_while_filtering(smol_dir, demo_ids, tmp_path, monkeypatch):
    """Continuous batching as the router does it, nvfp4: request B reuses A's first block (cache_len=256) and
    must score and generate exactly as the same prompt computed from scratch (C); a short request finishes and
    is filtered out while a new one joins the running batch; every request's cache equals its stored K/V."""
    tok, ids, _ = demo_ids
    a_ids, b_ids = ids[:300], ids[:BLOCK] + ids[400:480]
    a_text, b_text = tok.decode(a_ids), tok.decode(b_ids)
    assert tok(b_text, add_special_tokens=False).input_ids == b_ids
    spy = StoreSpy()
    with serving(smol_dir, "nvfp4", tmp_path, spy, monkeypatch) as (srv, router):
        ra, a = router.request(a_text, max_new_tokens=4, prompt_len=len(a_ids))
        router.run_to_end(router.prefill([ra]))
        rb, b = router.request(b_text, max_new_tokens=6, prompt_len=len(b_ids), prefill_logprobs=True, shared=a,
                               cache_len=BLOCK)
        router.run_to_end(router.prefill([rb]))
        rc, c = router.request(b_text, max_new_tokens=6, prompt_len=len(b_ids), prefill_logprobs=True)
        router.run_to_end(router.prefill([rc]))
        assert b.prompt_ids == b_ids and c.prompt_ids == b_ids
        assert b.tokens == c.tokens
        # TGI scores a prompt token from the previous position's logits: B computed positions 256.. only
        lb, lc = torch.tensor(b.prompt_logprobs[BLOCK + 1:]), torch.tensor(c.prompt_logprobs[BLOCK + 1:])
        assert torch.allclose(lb, lc, atol=0.02), (lb - lc).abs().max()

        # join while filtering: d (3 tokens) and e (12) run; d finishes and is filtered; f joins mid-decode
        rd, d = router.request(PROMPTS[0], max_new_tokens=3, prompt_len=8)
        re_, e = router.request(PROMPTS[2], max_new_tokens=12, prompt_len=16)
        batch = router.prefill([rd, re_])
        while not d.finished:
            batch = router.decode([batch])
        batch = router.filter(batch, [e.id])
        rf, f = router.request(PROMPTS[1], max_new_tokens=8, prompt_len=24)
        joined = router.prefill([rf])
        router.run_to_end(router.decode([batch, joined]))
        assert len(d.tokens) == 3 and len(e.tokens) == 12 and len(f.tokens) == 8
        caches = srv.model.kv_cache
        for seq in (a, b, e, f):
            prompt = len(tok(seq.text, add_special_tokens=False).input_ids)
            n = prompt + len(seq.tokens) - 1
            assert cache_mismatches(caches, spy, seq.blocks, n, required=prompt if GRAPHS else n) == [], seq.text[:40]
        solo = {}
        for p, k in ((PROMPTS[2], 12), (PROMPTS[1], 8)):
            r, s = router.request(p, max_new_tokens=k, prompt_len=24)
            router.run_to_end(router.prefill([r]))
            solo[p] = s.tokens
    assert e.tokens == solo[PROMPTS[2]] and f.tokens == solo[PROMPTS[1]]


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "mxfp4_rot"])
def test_small_local_llama_batched(fmt, tiny_dir, tmp_path, monkeypatch):
    """The Llama made here (2 layers, 4 query / 2 KV heads): warmup capacity at its geometry; three prompts of
    different lengths prefilled in one batch and decoded together; each request's cache equals its stored K/V."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    spy = StoreSpy()
    with serving(tiny_dir, fmt, tmp_path, spy, monkeypatch) as (srv, router):
        cap = parse_bytes(os.environ["KVX_KV_CACHE_MEMORY"])
        assert router.num_blocks == expected_blocks(get_format(fmt), cap, 2, BLOCK, 2, 64)
        reqs, seqs = zip(*(router.request(p, max_new_tokens=n, prompt_len=32)
                           for p, n in zip(PROMPTS, (5, 9, 7), strict=True)), strict=True)
        router.run_to_end(router.prefill(list(reqs)))
        for seq, n in zip(seqs, (5, 9, 7), strict=True):
            prompt = len(tok(seq.text, add_special_tokens=False).input_ids)
            assert len(seq.tokens) == n and seq.finished
            assert cache_mismatches(srv.model.kv_cache, spy, seq.blocks, prompt + n - 1,
                                    required=prompt if GRAPHS else prompt + n - 1) == []


@pytest.mark.parametrize("fmt, k_global, v_global", [("nvfp4", 0.05 * 448 / (6 * 448), 0.02 * 448 / (6 * 448)),
                                                     ("fp8_e4m3", 0.05, 0.02), ("int8", None, None)])
def test_checkpoint_kv_scales_set_global_scales(fmt, k_global, v_global, tiny_scaled_dir, tmp_path, monkeypatch):
    """Checkpoint k_scale/v_scale (amax / 448) become the global scales of the formats that have one (FP8: amax /
    448, NVFP4: amax / (6 * 448)); per-block formats keep none. Writes use them (the cache check decodes with the
    pools' global scales)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_scaled_dir)
    spy = StoreSpy()
    with serving(tiny_scaled_dir, fmt, tmp_path, spy, monkeypatch) as (srv, router):
        req, seq = router.request(PROMPTS[2], max_new_tokens=3, prompt_len=32)
        router.run_to_end(router.prefill([req]))
        for cache in srv.model.kv_cache:
            pools = cache.cache.layers[0]
            if k_global is None:
                assert pools.k_global is None and pools.v_global is None
            else:
                assert float(pools.k_global[0]) == pytest.approx(k_global, rel=1e-6)
                assert float(pools.v_global[0]) == pytest.approx(v_global, rel=1e-6)
        prompt = len(tok(PROMPTS[2], add_special_tokens=False).input_ids)
        assert cache_mismatches(srv.model.kv_cache, spy, seq.blocks, prompt) == []
