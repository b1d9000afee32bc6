"""vLLM serving with each KV cache dtype, one process per dtype on one GPU: KV capacity, decode and prefill speed.

    python benchmarks/bench_vllm.py --out benchmarks/results/vllm_kv_dtypes_h200.jsonl
    python benchmarks/bench_vllm.py --dtypes auto,kvx_nvfp4 --out /tmp/x.jsonl      # a subset
    python benchmarks/bench_vllm.py --tp 2 --dtypes auto,fp8,kvx_nvfp4 --cases b64_8k,b64_32k   # 2 GPUs, TP=2

Model (`--model`, `model_geometries.MODELS`): by default a random-weight Llama of 8B geometry cut to 8 layers
(hidden 4096, MLP 14336, GQA 32/8, head_dim 128, vocab 32000, bf16; `load_format="dummy"`, no tokenizer), so the
GPU's memory goes to the KV cache and attention is a real share of the step; gpt-oss-20b / Gemma 3 27B / Qwen3-8B
geometries cut to a few layers serve their window layers, sinks and softmax scales. Settings (the same for every dtype):
gpu_memory_utilization 0.85, prefix caching on, block size 16, max_num_batched_tokens 16384 (vLLM's LLM-class default on
80 GB GPUs), max_model_len 32768 + the decode steps, decode in full CUDA graphs (`cudagraph_mode=FULL_DECODE_ONLY`,
capture sizes 1..64) and no torch.compile (`mode=0`: every dtype would compile its own graphs, ~1 minute each; prefill
runs eagerly, which costs all dtypes alike).

Per dtype, JSON lines (`benchmarks/common.py` environment fields plus vllm version):
- `capacity`: KV tokens vLLM allocated, and requests of 32k tokens that fit at once (`max_concurrency_32k`).
- `prefill`: 64 random 8k-token prompts, one output token, wall time (cold prefix cache); `ttft`: one fresh 8k
  prompt alone, wall time to its one token.
- `decode` at B x ctx: the prompts' KV is cached first (prefix caching), then the same prompts run twice, with 1
  and with 1 + S output tokens; decode tok/s = B * S / (difference of the two wall times), so prefill and
  scheduling of the cached prompts cancel. B=64 at 8k and 32k (the 32k case runs only when the KV cache holds
  64 x 32k tokens and the 64 x 32k prefill is expected within `--long-prefill-s`, from 16x the measured 64 x 8k
  prefill; otherwise its line says why it was skipped) and B=1 at 32k.
- `prefix_hit` (not in the default cases): 16 of the 8k prompts, their KV cached, each extended by 4096 new random
  tokens, one output token, wall time: a prefill of 64k new tokens over 16 cached 8k prefixes (KVX's split prefill
  attends those prefixes over the pages: the dense route of `kvx_vllm.prefill.DensePrefix` on CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_geometries import DEFAULT, MODELS, write_config

DTYPES = ["auto", "fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "turboquant_k8v4",
          "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "nvfp4", "kvx_int8", "kvx_k8v4",
          "kvx_int4", "kvx_nvfp4", "kvx_mxfp4"]
"""Every KV cache dtype of vLLM 0.26's `CacheDType` that stores K/V per head (not `fp8_ds_mla`, `fp8_inc`), and
the kvx ones. A dtype vLLM refuses on the GPU at hand (e.g. its own `nvfp4` before Blackwell) fails its process:
the run goes on and names it at the end."""
MODEL = MODELS[DEFAULT]
CTX_SHORT, CTX_LONG, BATCH = 8192, 32768, 64


def _prompts(n: int, length: int, seed: int, vocab: int = MODEL["vocab_size"]) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def _timed(llm, prompts, tokens: int) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return dt


def _decode(llm, prompts, steps: int) -> dict:
    """Decode tok/s over cached prompts: (1 + steps) tokens minus 1 token, same prompts (prefix-cache hits). The
    1-token pass runs before and after the long one and the shorter counts: a pass that missed the prefix cache
    (seen with window models) would otherwise enter as a negative decode time; a long pass no slower than the short
    one is reported as not measured."""
    t0 = _timed(llm, prompts, 1)  # prefill: caches the prompts' KV (0 when they are cached already)
    t1 = _timed(llm, prompts, 1)
    tn = _timed(llm, prompts, 1 + steps)
    t1 = min(t1, _timed(llm, prompts, 1))
    out = {"batch": len(prompts), "ctx": len(prompts[0]["prompt_token_ids"]), "steps": steps,
           "first_pass_s": round(t0, 3), "one_token_s": round(t1, 4), "decode_s": round(tn - t1, 4)}
    if tn <= t1:
        return {**out, "skipped": f"not measured: the {1 + steps}-token pass ({tn:.3f} s) was no slower than the "
                                  f"1-token pass ({t1:.3f} s)"}
    return {**out, "tok_s": round(len(prompts) * steps / (tn - t1), 1)}


CASES = ("prefill", "b64_8k", "b64_32k", "b1_32k", "prefix_hit")
DEFAULT_CASES = CASES[:4]
HIT_BATCH, HIT_NEW = 16, 4096


def _prefix_hit(llm, prompts: list[dict], vocab: int) -> float:
    """Wall time of `prompts` extended by HIT_NEW new tokens each, one output token, their first CTX_SHORT tokens
    cached (run once first: a no-op when an earlier case cached them)."""
    _timed(llm, prompts, 1)
    tails = _prompts(len(prompts), HIT_NEW, seed=4, vocab=vocab)
    return _timed(llm, [{"prompt_token_ids": p["prompt_token_ids"] + t["prompt_token_ids"]}
                        for p, t in zip(prompts, tails, strict=True)], 1)


def _long_batch(llm, long, kv_tokens: int, steps: int, predicted_s: float, long_prefill_s: float) -> dict:
    """The B=64 x 32k decode, or why it was skipped (the cache cannot hold it, or its prefill would take too long:
    `predicted_s`, 16x the 64 x 8k prefill)."""
    if kv_tokens < BATCH * (CTX_LONG + steps + 16):
        return {"batch": BATCH, "ctx": CTX_LONG,
                "skipped": f"the KV cache holds {kv_tokens} tokens < {BATCH} x {CTX_LONG + steps}"}
    if predicted_s > long_prefill_s:
        return {"batch": BATCH, "ctx": CTX_LONG,
                "skipped": f"64 x 32k prefill expected ~{predicted_s:.0f} s (16x the 64 x 8k prefill) > "
                           f"--long-prefill-s {long_prefill_s:.0f}"}
    return _decode(llm, long, steps)


def run_one(dtype: str, out: str | None, steps: int, steps_b1: int, long_prefill_s: float,
            cases: tuple[str, ...] = DEFAULT_CASES, model: str = DEFAULT, tp: int = 1,
            kvx_prefill: str | None = None) -> None:
    """Everything for one dtype in this process (the capacity, then `cases`); `tp` GPUs in tensor parallel;
    `kvx_prefill`: the plugin's `prefill` option for kvx dtypes (default: the plugin's)."""
    import vllm
    from common import emit, env_info
    from vllm import LLM

    base = {**env_info(), "bench": "vllm", "vllm": vllm.__version__, "model": model, "kv_cache_dtype": dtype,
            "tensor_parallel_size": tp}
    extra = {}
    if kvx_prefill and dtype.startswith("kvx_"):
        base["kvx_prefill"] = kvx_prefill
        extra["additional_config"] = {"kvx": {"prefill": kvx_prefill}}
    vocab = MODELS[model]["vocab_size"]
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(model, model_dir)
        t0 = time.perf_counter()
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  kv_cache_dtype=dtype, max_model_len=CTX_LONG + max(steps, steps_b1) + 16, block_size=16,
                  gpu_memory_utilization=0.85, enable_prefix_caching=True, max_num_seqs=BATCH,
                  max_num_batched_tokens=16384, seed=0, tensor_parallel_size=tp,
                  compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]}, **extra)
        cc = llm.llm_engine.vllm_config.cache_config
        kv_tokens = cc.num_gpu_blocks * cc.block_size
        emit(out, {**base, "metric": "capacity", "kv_tokens": kv_tokens, "block_size": cc.block_size,
                   "max_concurrency_32k": round(kv_tokens / CTX_LONG, 2),
                   "startup_s": round(time.perf_counter() - t0, 1)})

        short = _prompts(BATCH, CTX_SHORT, seed=1, vocab=vocab)
        t_prefill = None
        if "prefill" in cases or "b64_32k" in cases:
            t_prefill = _timed(llm, short, 1)
        if "prefill" in cases:
            emit(out, {**base, "metric": "prefill", "batch": BATCH, "ctx": CTX_SHORT,
                       "prefill_s": round(t_prefill, 3)})
            emit(out, {**base, "metric": "ttft", "ctx": CTX_SHORT,
                       "ttft_s": round(_timed(llm, _prompts(1, CTX_SHORT, seed=2, vocab=vocab), 1), 4)})
        if "b64_8k" in cases:
            emit(out, {**base, "metric": "decode", **_decode(llm, short, steps)})
        if "prefix_hit" in cases:
            emit(out, {**base, "metric": "prefix_hit", "batch": HIT_BATCH, "cached": CTX_SHORT, "new": HIT_NEW,
                       "prefill_s": round(_prefix_hit(llm, short[:HIT_BATCH], vocab), 3)})
        llm.reset_prefix_cache()

        long = _prompts(BATCH, CTX_LONG, seed=3, vocab=vocab)
        if "b64_32k" in cases:
            emit(out, {**base, "metric": "decode", **_long_batch(llm, long, kv_tokens, steps, 16 * t_prefill,
                                                                   long_prefill_s)})
        if "b1_32k" in cases:
            emit(out, {**base, "metric": "decode", **_decode(llm, long[:1], steps_b1)})


def summarize(path: str) -> str:
    """A markdown table of a results file: each (model, dtype)'s numbers and ratios to `auto` of the same model."""
    rows: dict[tuple[str, str], dict] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        r = json.loads(line)
        model = r.get("model", DEFAULT) + (f" TP={r['tensor_parallel_size']}" if r.get("tensor_parallel_size", 1) > 1
                                           else "")
        d = rows.setdefault((model, r["kv_cache_dtype"]), {})
        if r["metric"] == "decode":
            key = f"decode_b{r['batch']}_{r['ctx'] // 1024}k"
            d[key] = r.get("tok_s", "skipped")
        elif r["metric"] in ("capacity", "prefill", "ttft"):
            d.update({k: r[k] for k in ("kv_tokens", "prefill_s", "ttft_s") if k in r})
        elif r["metric"] == "prefix_hit":
            d["prefix_hit_s"] = r["prefill_s"]
    cols = [("kv_tokens", "KV tokens"), ("decode_b64_8k", "decode B64 8k tok/s"),
            ("decode_b64_32k", "decode B64 32k tok/s"), ("decode_b1_32k", "decode B1 32k tok/s"),
            ("prefill_s", "prefill 64x8k s"), ("ttft_s", "TTFT 8k s"),
            ("prefix_hit_s", f"prefill {HIT_BATCH}x{HIT_NEW // 1024}k over cached 8k s")]
    cols = [c for c in cols if any(c[0] in d for d in rows.values())]
    out = ["| model | dtype | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for (model, dtype), d in rows.items():
        base = rows.get((model, "auto"), {})
        cells = []
        for key, _ in cols:
            v, b = d.get(key), base.get(key)
            if not isinstance(v, (int, float)):
                cells.append(str(v or "-"))
            elif isinstance(b, (int, float)) and dtype != "auto":
                cells.append(f"{v:,} ({v / b:.2f}x)")
            else:
                cells.append(f"{v:,}")
        out.append(f"| {model} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated --kv-cache-dtype values")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed at B=64")
    ap.add_argument("--steps-b1", type=int, default=256, help="decode steps timed at B=1")
    ap.add_argument("--long-prefill-s", type=float, default=150.0,
                    help="skip the B=64 x 32k decode when its prefill is expected to take longer (s)")
    ap.add_argument("--timeout-s", type=int, default=420, help="limit per dtype process")
    ap.add_argument("--summarize", metavar="JSONL", help="print a markdown table of a results file and exit")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated subset of {','.join(CASES)} "
                    "(the capacity line is always written; prefix_hit only when named)")
    ap.add_argument("--model", default=DEFAULT, choices=list(MODELS), help="model geometry (random weights)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per dtype process)")
    ap.add_argument("--kvx-prefill", choices=("split", "split_fused", "cache"),
                    help="the plugin's prefill option for the kvx dtypes (default: the plugin's default)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run this dtype here
    a = ap.parse_args()
    if a.summarize:
        print(summarize(a.summarize))
        return
    if a.one:
        cases = tuple(a.cases.split(","))
        if not set(cases) <= set(CASES):
            ap.error(f"--cases: unknown {sorted(set(cases) - set(CASES))}; choose from {', '.join(CASES)}")
        run_one(a.one, a.out, a.steps, a.steps_b1, a.long_prefill_s, cases, a.model, a.tp, a.kvx_prefill)
        return
    from common import run_per_process

    run_per_process(os.path.abspath(__file__), a.dtypes.split(","),
                    ["--steps", str(a.steps), "--steps-b1", str(a.steps_b1), "--long-prefill-s", str(a.long_prefill_s),
                     "--cases", a.cases, "--model", a.model, "--tp", str(a.tp),
                     *(["--kvx-prefill", a.kvx_prefill] if a.kvx_prefill else [])],
                    a.out, a.timeout_s)

if __name__ == "__main__":
    main()
