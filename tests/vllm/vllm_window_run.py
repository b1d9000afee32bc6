"""One offline vLLM CPU run of a sliding-window model for one cache dtype; prints one JSON line of results.

    python tests/vllm/vllm_window_run.py MODEL_DIR CACHE_DTYPE

MODEL_DIR: SmolLM2-135M with `layer_types` alternating "sliding_attention" / "full_attention" and a `sliding_window`
(`test_vllm_window.window_model_dir`): vLLM's Llama gives the even layers a window, so the run has a full and a
window KV cache group (the hybrid allocator). Blocks of 32 tokens under a 64-token window: blocks fall out of the
window (vLLM frees them) in the 512-token perplexity text, in the decode past the window, and before a prefix hit.
Measures: KV cache groups, prompt_logprobs perplexity (256-token chunks: the second one's split prefill reads its
prefix through the window), greedy tokens decoded past the window, prefix-cache reuse with a hit past the window.
"""
from __future__ import annotations

import json
import sys

from vllm_run import prefix_reuse, score_demo_text  # this folder is the script's sys.path[0]

BLOCK = 32
PPL_TOKENS = 512
GEN_TOKENS = 96
PREFIX_REPEAT = 27  # 270 shared tokens: a hit of 256 (8 blocks, 6 of them out of the window: null in the table),
#                    where the cold run's second 256-token chunk starts, so hit and miss split alike


def main(model: str, cache_dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=True, seed=0, block_size=BLOCK,
              distributed_executor_backend="uni")
    cfg = llm.llm_engine.vllm_config
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    out: dict = {"dtype": cache_dtype, "block_size": cfg.cache_config.block_size,
                 "groups": sorted([type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                                   len(g.layer_names)] for g in groups)}

    ids, _, out["ppl"] = score_demo_text(llm, model, PPL_TOKENS)

    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    gen = llm.generate([{"prompt_token_ids": ids[:40]}], greedy, use_tqdm=False)[0]
    out["gen_tokens"] = list(gen.outputs[0].token_ids)
    # the generated sequence re-scored in one teacher-forced prefill: each decoded token's gap to the top token
    full = ids[:40] + out["gen_tokens"]
    rescored = llm.generate([{"prompt_token_ids": full}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0]
    out["greedy_gaps"] = [next(v for v in lp.values() if v.rank == 1).logprob - lp[t].logprob
                          for t, lp in zip(full[40:], rescored.prompt_logprobs[40:], strict=True)]

    out["prefix"] = prefix_reuse(llm, PREFIX_REPEAT)
    return out


if __name__ == "__main__":
    print("KVX_RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
