"""One offline vLLM run of SmolLM2-135M on CPU for one cache dtype; prints one JSON line of results.

Run as a script (vLLM spawns an engine-core process, so it needs its own `__main__`):
    python tests/vllm/vllm_run.py CKPT_DIR CACHE_DTYPE [--rotate] [--prefill-cache] [--multiproc] [--preempt]
    python tests/vllm/vllm_run.py --runs RUNS_JSON    (a list of [CKPT_DIR, CACHE_DTYPE, *FLAGS])
Without --multiproc the engine core and worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0
and the 'uni' executor, set by the caller's environment / here). --prefill-cache runs the "cache" prefill route
(everything over the KVX pages) instead of the default split prefill.
Measures: KV capacity vLLM reports, generation for prompts of different lengths, greedy
continuations, `prompt_logprobs` perplexity on the demo text, and prefix-cache reuse.
`--runs`: the runs one after another in this process, each engine shut down (its distributed state and memory)
before the next starts; one JSON line of their results in order: vLLM is imported once, not once per run.
"""
from __future__ import annotations

import json
import math
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Python lists are mutable sequences. To add an item to the end of a list, call",
           "A" * 3 + " short one:"]
PPL_TOKENS = 512  # demo-text tokens scored with prompt_logprobs (two chunks of prefill)
GEN_TOKENS = 24
PREEMPT_GEN = 160
PREEMPT_KV_TOKENS = 1280
PREFIX_REPEAT = 30  # shared prefix of ~300 tokens: two full 128-token blocks


def main(ckpt: str, cache_dtype: str, rotate: bool, multiproc: bool, prefill: str) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kvx = {k: v for k, v in (("rotate", rotate), ("prefill", prefill)) if v not in (False, "split")}
    extra = {"additional_config": {"kvx": kvx}} if kvx else {}
    if not multiproc:  # engine core and worker in this process: ~40 s less startup on 2 cores
        extra["distributed_executor_backend"] = "uni"
    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=True, seed=0, **extra)
    startup = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    out: dict = {"dtype": cache_dtype, "rotate": rotate, "prefill": prefill, "startup_s": round(startup, 1),
                 "num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size}

    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    gens = llm.generate(PROMPTS, greedy, use_tqdm=False)
    out["gen_tokens"] = [list(g.outputs[0].token_ids) for g in gens]
    out["gen_text"] = [g.outputs[0].text for g in gens]
    t_gen = time.perf_counter()

    _, scored, out["ppl"] = score_demo_text(llm, ckpt, PPL_TOKENS)
    # greedy next token at every position of the text (teacher-forced), to compare dtypes position by position
    out["text_top1"] = [next(t for t, v in lp.items() if v.rank == 1) for lp in scored.prompt_logprobs[1:]]
    t_ppl = time.perf_counter()

    out["prefix"] = prefix_reuse(llm, PREFIX_REPEAT)
    t1 = time.perf_counter()
    out["timing"] = {"gen": round(t_gen - t0 - startup, 1), "ppl": round(t_ppl - t_gen, 1),
                     "prefix": round(t1 - t_ppl, 1)}
    out["total_s"] = round(time.perf_counter() - t0, 1)
    llm.llm_engine.engine_core.shutdown()
    return out


def preempt(ckpt: str, cache_dtype: str) -> dict:
    """Preemption and recompute: a KV cache of 1280 tokens (10 blocks of 128 on CPU, 80 of 16 on CUDA) cannot
    hold 4 concurrent requests of ~140-190 + 160 tokens, so vLLM preempts some and later recomputes their pages.
    Records what KVX owns there: the block pool's free count before and after (every block released), and, per
    request, how far each generated token's logprob lies below the top logprob when the finished sequence is
    re-scored alone (teacher-forced prefill over fresh pages, no preemption): a page written wrongly on recompute
    shows as tokens far from greedy; batch-variance noise stays within a small margin. The cache prefill route
    (`{"kvx": {"prefill": "cache"}}`): recompute and re-score then read the pages exactly as decode did (the split
    route's chunks would see their own K/V unquantized, a view decode never had: up to 2.4 nats apart for int4)."""
    import torch
    from vllm import LLM, SamplingParams

    block = 16 if torch.cuda.is_available() else 128
    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False, seed=0, block_size=block,
              num_gpu_blocks_override=PREEMPT_KV_TOKENS // block, disable_log_stats=False,
              distributed_executor_backend="uni", additional_config={"kvx": {"prefill": "cache"}},
              # CUDA: the cache's memory given, not profiled (runs sharing the GPU would disturb the profile)
              **({"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 1 << 30} if block == 16 else {}))
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool  # in-process engine core
    base = "Write a long story about a lighthouse keeper and the ships that pass in the night. "
    prompts = [base * (8 + i) + f"Chapter {i + 1}:" for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=PREEMPT_GEN, ignore_eos=True)
    free_before = pool.get_num_free_blocks()
    before = _preemptions(llm)
    together = llm.generate(prompts, greedy, use_tqdm=False)
    preemptions = _preemptions(llm) - before
    free_after = pool.get_num_free_blocks()
    gaps = []
    for r in together:  # one at a time: 1280 tokens hold one ~490-token sequence without preemption
        ids = list(r.prompt_token_ids) + list(r.outputs[0].token_ids)
        scored = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                              use_tqdm=False)[0]
        n = len(r.prompt_token_ids)
        gaps.append([_rank1(lp).logprob - lp[t].logprob
                     for t, lp in zip(ids[n:], scored.prompt_logprobs[n:], strict=True)])
    cc = llm.llm_engine.vllm_config.cache_config
    out = {"dtype": cache_dtype, "num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
           "prompt_tokens": [len(r.prompt_token_ids) for r in together], "preemptions": preemptions,
           "free_blocks_before": free_before, "free_blocks_after": free_after,
           "finished": [r.finished for r in together],
           "together": [list(r.outputs[0].token_ids) for r in together], "greedy_gaps": gaps}
    llm.llm_engine.engine_core.shutdown()  # after reading the cache config: the shutdown clears its block count
    return out


def _rank1(lp: dict):
    return next(v for v in lp.values() if v.rank == 1)


def _preemptions(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def score_demo_text(llm, model: str, tokens: int):
    """The demo text's first `tokens` tokens scored teacher-forced (`prompt_logprobs`): (their ids, the request's
    output, the perplexity)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from kvx_demo.text import default_text, tokenize

    ids = tokenize(AutoTokenizer.from_pretrained(model), default_text(), max_tokens=tokens).tolist()
    scored = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)[0]
    nll = [-lp[t].logprob for t, lp in zip(ids[1:], scored.prompt_logprobs[1:], strict=True)]
    return ids, scored, math.exp(sum(nll) / len(nll))


def prefix_reuse(llm, repeat: int) -> dict:
    """A prompt sharing `repeat` sentences with an earlier one, run warm (its prefix cached) and cold: the tokens
    cached and both runs' greedy tokens with their top-5 log-probs."""
    from vllm import SamplingParams

    prefix = " ".join(["The quick brown fox jumps over the lazy dog."] * repeat)
    probe = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    llm.generate([prefix + " First question: what"], probe, use_tqdm=False)
    warm = llm.generate([prefix + " Second question: why"], probe, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    cold = llm.generate([prefix + " Second question: why"], probe, use_tqdm=False)[0]
    return {"prompt_tokens": len(warm.prompt_token_ids), "warm_cached": warm.num_cached_tokens,
            "cold_cached": cold.num_cached_tokens, "warm": _logprobs(warm), "cold": _logprobs(cold)}


def _logprobs(req) -> list[list]:
    """Per generated position: the sampled token and the top-5 (token, logprob) pairs."""
    o = req.outputs[0]
    return [[t, sorted((k, v.logprob) for k, v in lp.items())] for t, lp in zip(o.token_ids, o.logprobs, strict=True)]


def run(ckpt: str, cache_dtype: str, *flags: str) -> dict:
    """One run of the command line's arguments."""
    if "--preempt" in flags:
        return preempt(ckpt, cache_dtype)
    return main(ckpt, cache_dtype, "--rotate" in flags, "--multiproc" in flags,
                "cache" if "--prefill-cache" in flags else "split")


if __name__ == "__main__":
    res = [run(*args) for args in json.loads(sys.argv[2])] if sys.argv[1] == "--runs" else run(*sys.argv[1:])
    print("KVX_RESULT " + json.dumps(res), flush=True)
