"""One offline vLLM 0.26 run on a CUDA GPU for one cache dtype; prints one `KVX_RESULT {json}` line.

    python tests/vllm/vllm_gpu_run.py CKPT_DIR CACHE_DTYPE [--eager] [--prefill-cache]

CKPT_DIR: an HF checkpoint with its tokenizer (the demo's SmolLM2-135M, e.g. a bf16 copy). Measures: the KV
blocks vLLM makes of `KV_BYTES`, greedy continuations (with logprobs) of prompts of several lengths batched together
(decode in full CUDA graphs unless --eager; no torch.compile either way, so graph and eager runs share their
prefill), `prompt_logprobs` perplexity of 4096 demo-text tokens, and prefix-cache reuse (warm vs cold logprobs of
the same request). Prefill runs in 512-token chunks: under the default split prefill a chunk sees its own K/V
exactly and everything before it through the KVX pages, so the perplexity measures the quantized cache over 7/8
of the text, and the 1024-token prefix of the reuse probe ends on a chunk boundary in the cold run too.
--prefill-cache: `{"kvx": {"prefill": "cache"}}` (every prompt token over the pages).
"""
from __future__ import annotations

import json
import math
import sys
import time

PROMPT_LENS = [5, 100, 333, 1500, 4000]
GEN_TOKENS = 32
PPL_TOKENS = 4096
KV_BYTES = 2 << 30
"""The KV cache's memory, fixed (vLLM's `kv_cache_memory_bytes`) rather than profiled from a utilization, so the
capacity compares formats exactly and runs sharing the GPU (the GPU suite beside them) size their caches alike."""


def _logprobs(completion) -> list[float]:
    """The log-probability of each generated token of a vLLM completion."""
    return [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]


def main(ckpt: str, cache_dtype: str, eager: bool, prefill_cache: bool) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvx_demo.text import default_text, tokenize

    t0 = time.perf_counter()
    compilation = {"mode": 0, "cudagraph_mode": "NONE" if eager else "FULL_DECODE_ONLY",
                   "cudagraph_capture_sizes": [1, 2, 4, 8]}
    extra = {"additional_config": {"kvx": {"prefill": "cache"}}} if prefill_cache else {}
    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=8192, max_num_seqs=8,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3, kv_cache_memory_bytes=KV_BYTES,
              enable_prefix_caching=True, seed=0,
              compilation_config=compilation, **extra)
    cc = llm.llm_engine.vllm_config.cache_config
    out: dict = {"dtype": cache_dtype, "eager": eager, "prefill": "cache" if prefill_cache else "split",
                 "startup_s": round(time.perf_counter() - t0, 1),
                 "num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size}
    ids = tokenize(AutoTokenizer.from_pretrained(ckpt), default_text(), max_tokens=20000).tolist()
    prompts = [ids[1000 * i:1000 * i + n] for i, n in enumerate(PROMPT_LENS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=1)
    gens = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    out["gen_tokens"] = [list(g.outputs[0].token_ids) for g in gens]
    out["gen_logprobs"] = [_logprobs(g.outputs[0]) for g in gens]
    scored_ids = ids[:PPL_TOKENS]
    scored = llm.generate([TokensPrompt(prompt_token_ids=scored_ids)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    out["prompt_logprobs"] = [lp[t].logprob for t, lp in zip(scored_ids[1:], scored.prompt_logprobs[1:], strict=True)]
    out["ppl"] = math.exp(-sum(out["prompt_logprobs"]) / len(out["prompt_logprobs"]))
    prefix = ids[5000:6024]
    probe = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prefix + ids[7000:7003])], probe, use_tqdm=False)
    warm = llm.generate([TokensPrompt(prompt_token_ids=prefix + ids[8000:8002])], probe, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    cold = llm.generate([TokensPrompt(prompt_token_ids=prefix + ids[8000:8002])], probe, use_tqdm=False)[0]
    out["prefix"] = {"warm_cached": warm.num_cached_tokens, "cold_cached": cold.num_cached_tokens,
                     "warm_tokens": list(warm.outputs[0].token_ids), "cold_tokens": list(cold.outputs[0].token_ids),
                     "warm": _logprobs(warm.outputs[0]), "cold": _logprobs(cold.outputs[0])}
    out["total_s"] = round(time.perf_counter() - t0, 1)
    return out


if __name__ == "__main__":
    flags = sys.argv[3:]
    print("KVX_RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], "--eager" in flags, "--prefill-cache" in flags)),
          flush=True)
