"""One offline vLLM run (CPU, SmolLM2-135M, one KVX cache dtype) of greedy generation without speculation, with the
n-gram speculator or with an EAGLE draft head; prints one JSON line of results.

    python tests/vllm/vllm_specdec_run.py CKPT_DIR CACHE_DTYPE [--spec | --eagle DRAFT_DIR]

Engine core and worker run in this process (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0; the 'uni' executor
here), so the run counts the decode plans the KVX metadata builder makes per `rows_per_seq` (a wrapper around the
backend's `plan_decode`): with --spec or --eagle, verification steps of 1 + k tokens per request must have run as
multi-row decodes. With --eagle, vLLM's EAGLE proposer drafts with the head in DRAFT_DIR, whose attention layer runs
through the KVX backend too: the run also counts the plans the drafter's builder made (`build_for_drafting`, as
`draft_index:plan type:rows per request`: the pass over the step's tokens, then a one-row decode per further draft
token). Records the generated tokens, their top-2 logprobs per position (to tell a near tie from a real
disagreement) and vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens per position).
"""
from __future__ import annotations

import json
import sys
from collections import Counter

PROMPTS = ["1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2,",
           "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
           "The capital of France is"]
GEN_TOKENS = 40
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
EAGLE_TOKENS = 3


def spec_config(argv: list[str]) -> dict | None:
    """The run's `speculative_config` from its flags: n-gram (--spec), EAGLE (--eagle DRAFT_DIR) or none."""
    if "--eagle" in argv:
        return {"method": "eagle", "model": argv[argv.index("--eagle") + 1], "num_speculative_tokens": EAGLE_TOKENS}
    return SPEC if "--spec" in argv else None


def main(ckpt: str, cache_dtype: str, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    import kvx_vllm.backend as backend

    rows, drafting = Counter(), Counter()
    plan, build_for_drafting = backend.plan_decode, backend.KvxMetadataBuilder.build_for_drafting

    def counting(*args, rows_per_seq: int = 1, **kw):
        rows[rows_per_seq] += 1
        return plan(*args, rows_per_seq=rows_per_seq, **kw)

    def counting_drafts(self, common_attn_metadata, draft_index: int):
        md = build_for_drafting(self, common_attn_metadata, draft_index)
        drafting[f"{draft_index}:{type(md.plan).__name__}:{getattr(md.plan, 'rows_per_seq', '-')}"] += 1
        return md

    backend.plan_decode = counting
    backend.KvxMetadataBuilder.build_for_drafting = counting_drafts
    extra = {"speculative_config": spec} if spec else {}
    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, max_num_batched_tokens=256, seed=0, disable_log_stats=False,
              distributed_executor_backend="uni", **extra)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True,
                            logprobs=2)
    # one request at a time: every verification step is then uniform (the n-gram speculator drafts 0..k tokens per
    # request, so batched requests rarely share a query length: such steps take the prefill route), and greedy
    # tokens do not depend on which requests share a step (vLLM CPU is not batch-invariant, README)
    gens = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    out = {"dtype": cache_dtype, "spec": spec, "tokens": [list(g.outputs[0].token_ids) for g in gens],
           "decode_plans_by_rows": {str(k): v for k, v in sorted(rows.items())},
           "drafting_plans": dict(sorted(drafting.items()))}
    # per position: the two best (token, logprob) pairs (with speculation: of the target's verification logits)
    out["top2"] = [[sorted(((t, v.logprob) for t, v in lp.items()), key=lambda x: -x[1])[:2]
                    for lp in g.outputs[0].logprobs] for g in gens]
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    out["spec_metrics"] = metrics
    return out


if __name__ == "__main__":
    res = main(sys.argv[1], sys.argv[2], spec_config(sys.argv[3:]))
    print("KVX_RESULT " + json.dumps(res), flush=True)
