"""vLLM runs of one model geometry (`benchmarks/model_geometries.py`: gpt-oss-20b, Gemma 3 27B, Qwen3-8B cut to a
few layers) with random weights, one engine after another in this process, for each KV cache dtype; prints one
`KVX_RESULT {json}` line per run.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/vllm/vllm_models_run.py MODEL RUN[,RUN...]

RUN: a KV cache dtype, or `DTYPE:spec` for its run with the n-gram speculator; the first run without `:spec` is
the baseline the others' log-probs are compared with (`auto`).

Engine core and worker run in this process (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0), so two things
can be hooked in:
- the weights: vLLM's dummy loader draws U(-1e-3, 1e-3), under which norms are ~0 and logits ~uniform whatever
  attention computes; `model_geometries.realistic_weights` redraws them (seeded: every dtype's run has the same
  weights), so the log-probs depend on the cache.
- an FP64 oracle of every KVX decode: at decode steps whose longest sequence reaches past the layer's window
  (and for every `rows_per_seq` that ran), once per layer, the step's output is compared with
  `kvx_core.ops.attention.paged_decode` over the same pages, block table and lengths (dequantized, the window,
  sinks and softmax scale the layer was given): `oracle[layer] = max |out - ref| / max |ref|`.

Per dtype (eager, prefill in 512-token chunks so most prompt tokens attend their prefix through the pages):
KV cache groups and blocks, `prompt_logprobs` of two 3072-token random prompts (log-prob of each token and the
top-1 token per position, compared with the first dtype's run, `auto`, in the summary fields), greedy
continuations of prompts with repeats (the longest, 1500 tokens, decodes past a 1024-token window). `DTYPE:spec`:
two engines with the LM head tied to the embedding (`realistic_weights(tie_head=True)`: greedy continuations
repeat, so the n-gram speculator drafts): the greedy continuations without speculation (`gen_base`, with the two
best log-probs per position) and with vLLM's n-gram speculator (3 tokens, `gen`), its acceptance counters and the
decode plans per `rows_per_seq`. No torch.compile (`mode` 0): every run would compile its own graphs.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from model_geometries import MODELS, realistic_weights, write_config

PROMPT_TOKENS = 3072
CHUNK = 512
GEN_TOKENS = 48
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
ORACLE_PAST = 64  # a decode is checked once its longest sequence is this far past the layer's window


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(two random prompts to score, four prompts with repeats for greedy / n-gram runs), fixed by seeds."""
    import torch

    g = torch.Generator().manual_seed(7)
    scored = [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(2)]
    greedy = []
    for period, reps, tail in ((16, 8, 0), (40, 5, 7), (97, 3, 11), (300, 5, 0)):
        unit = torch.randint(3, vocab, (period,), generator=g).tolist()
        greedy.append(unit * reps + unit[:tail])
    return scored, greedy


class Oracle:
    """Wraps the KVX backend's forward to check decodes against the FP64 reference (module docstring)."""

    def __init__(self):
        self.errors: dict[str, float] = {}
        self.plans = Counter()

    def install(self):
        from kvx_core.ops.attention import paged_decode
        from kvx_vllm import backend

        orig = backend.KvxAttentionImpl.forward
        oracle = self

        def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            res = orig(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            plan = getattr(attn_metadata, "plan", None)
            if getattr(plan, "what", None) != "paged_decode":
                return res
            tag = f"{layer.layer_name}@rows{plan.rows_per_seq}"
            oracle.plans[plan.rows_per_seq] += 1
            if tag in oracle.errors or int(plan.seq_lens.lengths.max()) < (impl.window or 0) + ORACLE_PAST:
                return res
            n = attn_metadata.num_actual_tokens
            q = query[:n].view(n, impl.num_heads, impl.head_size).float()
            desc = impl.cache_desc(layer, kv_cache)
            ref, _ = paged_decode(q, desc, plan.table, plan.seq_lens, sm_scale=impl.scale, softcap=impl.softcap,
                                  window=impl.window, sinks=impl._sinks, rows_per_seq=plan.rows_per_seq)
            got = output[:n].view(n, impl.num_heads, impl.head_size).float()
            oracle.errors[tag] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            return res

        backend.KvxAttentionImpl.forward = forward


TIE_HEAD = {"on": False}
"""Whether the next engine's weights tie the LM head to the embedding (the speculative runs)."""


def _realistic_loader():
    """vLLM's dummy loader followed by `realistic_weights` (before vLLM processes the weights: sinks are read then)."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    orig = DummyModelLoader.load_weights

    def load_weights(self, model, model_config):
        orig(self, model, model_config)
        realistic_weights(model, tie_head=TIE_HEAD["on"])

    DummyModelLoader.load_weights = load_weights


def run(model_dir: str, vocab: int, dtype: str, spec: bool, oracle: Oracle, *, tied: bool = False,
        score: bool = True) -> dict:
    """One engine: `spec` with the n-gram speculator, `tied` with the tied LM head, `score` the prompt log-probs."""
    from vllm import LLM, SamplingParams

    scored, greedy = _prompts(vocab)
    t0 = time.perf_counter()
    oracle.errors.clear()
    oracle.plans.clear()
    TIE_HEAD["on"] = tied
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype=dtype,
              max_model_len=PROMPT_TOKENS + 2 * GEN_TOKENS, max_num_seqs=8, max_num_batched_tokens=CHUNK,
              enable_prefix_caching=False, enforce_eager=True, seed=0, distributed_executor_backend="uni",
              gpu_memory_utilization=0.3, kv_cache_memory_bytes=4 << 30, disable_log_stats=False,
              compilation_config={"mode": 0},
              **({"speculative_config": SPEC} if spec else {}))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    out: dict = {"dtype": dtype, "spec": spec, "tied_head": tied, "startup_s": round(time.perf_counter() - t0, 1),
                 "groups": sorted([type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                                   len(g.layer_names)] for g in sched.kv_cache_config.kv_cache_groups),
                 "num_blocks": sched.kv_cache_config.num_blocks}
    if score:
        res = llm.generate([{"prompt_token_ids": p} for p in scored],
                           SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False), use_tqdm=False)
        out["logprobs"] = [[lp[t].logprob for t, lp in zip(p[1:], r.prompt_logprobs[1:], strict=True)]
                           for p, r in zip(scored, res, strict=True)]
        out["top1"] = [[next(k for k, v in lp.items() if v.rank == 1) for lp in r.prompt_logprobs[1:]] for r in res]
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True, detokenize=False,
                            **({} if spec else {"logprobs": 2}))
    # one request at a time: a verification step is then uniform (1 + k rows), not split off a mixed batch
    gens = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in greedy]
    out["gen"] = [list(g.outputs[0].token_ids) for g in gens]
    if not spec:  # per position, the best two log-probs: a near tie explains a speculative run's other choice
        out["top2"] = [[sorted((v.logprob for v in lp.values()), reverse=True)[:2] for lp in g.outputs[0].logprobs]
                       for g in gens]
    out["spec_metrics"] = {m.name: getattr(m, "values", None) or getattr(m, "value", None)
                           for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    out["oracle"] = dict(oracle.errors)
    out["decode_plans_by_rows"] = {str(k): v for k, v in sorted(oracle.plans.items())}
    out["total_s"] = round(time.perf_counter() - t0, 1)
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    return out


def compare(run: dict, base: dict) -> dict:
    """Prompt log-probs of `run` vs `base` (same prompts and weights): perplexities, mean |difference| of each
    token's log-prob, share of positions whose top-1 token agrees."""
    a = [x for row in run["logprobs"] for x in row]
    b = [x for row in base["logprobs"] for x in row]
    ta = [x for row in run["top1"] for x in row]
    tb = [x for row in base["top1"] for x in row]
    return {"ppl": math.exp(-sum(a) / len(a)), "ppl_base": math.exp(-sum(b) / len(b)),
            "mean_abs_dlogprob": sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a),
            "top1_agree": sum(x == y for x, y in zip(ta, tb, strict=True)) / len(ta)}


def speculative(model_dir: str, vocab: int, dtype: str, oracle: Oracle) -> dict:
    """The `DTYPE:spec` pair (module docstring): the tied-head model's greedy tokens without and with speculation."""
    base = run(model_dir, vocab, dtype, False, oracle, tied=True, score=False)
    out = run(model_dir, vocab, dtype, True, oracle, tied=True, score=False)
    out.update(gen_base=base["gen"], top2_base=base["top2"], oracle_base=base["oracle"])
    return out


def main(model: str, runs: list[str]) -> None:
    import tempfile

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        sys.exit("set VLLM_ENABLE_V1_MULTIPROCESSING=0 (the hooks need the engine core in this process)")
    oracle = Oracle()
    oracle.install()
    _realistic_loader()
    base = None
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(model, model_dir)
        for dtype, with_spec in ((r.removesuffix(":spec"), r.endswith(":spec")) for r in runs):
            try:
                vocab = MODELS[model]["vocab_size"]
                r = speculative(model_dir, vocab, dtype, oracle) if with_spec else run(model_dir, vocab, dtype, False,
                                                                                      oracle)
            except Exception as e:  # noqa: BLE001 (recorded: the next dtype still runs)
                r = {"dtype": dtype, "spec": with_spec, "error": f"{type(e).__name__}: {e}"[:2000]}
            r["model"] = model
            if "logprobs" in r:
                base = base or r
                r["vs_" + base["dtype"]] = compare(r, base)
                slim = {k: v for k, v in r.items() if k not in ("logprobs", "top1")}
            else:
                slim = r
            print("KVX_RESULT " + json.dumps(slim), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
