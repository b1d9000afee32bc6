"""Where a vLLM decode step's GPU time goes, per KV cache dtype: CUDA kernel time by kernel over decode steps.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/profile_vllm_decode.py --dtype kvx_nvfp4 [--batch 64 --ctx 8192]
        [--model gemma3-27b-6l]   # a geometry of model_geometries.MODELS (Gemma 3: KVX 0.61-0.73x auto, B=1 x 32k)

`bench_vllm.py`'s model and settings, eager (CUPTI sees every kernel; kernel times do not depend on graphs), the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its kernels. The prompts
are cached first; the profile covers `--steps` decode steps (plus the one-token recompute of the cached prompts).
Prints one JSON line: per kernel (name cut to 90 characters) its total ms and calls, the step's total kernel ms,
the kernel launches in all and per step (the CUDA-graph node count of a step), and the model's layer count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm import _prompts  # noqa: E402
from model_geometries import DEFAULT, MODELS, write_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--model", default=DEFAULT, choices=list(MODELS), help="model geometry (random weights)")
    a = ap.parse_args()
    import torch
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as model_dir:
        cfg = write_config(a.model, model_dir)
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  kv_cache_dtype=a.dtype, max_model_len=a.ctx + a.steps + 16, block_size=16,
                  gpu_memory_utilization=0.85, enable_prefix_caching=True, max_num_seqs=a.batch,
                  max_num_batched_tokens=16384, seed=0, enforce_eager=True)
        prompts = _prompts(a.batch, a.ctx, seed=1, vocab=cfg["vocab_size"])
        sp = lambda n: SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)  # noqa: E731
        llm.generate(prompts, sp(1), use_tqdm=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp(1 + a.steps), use_tqdm=False)
            torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count > 0:
            rows[e.key[:90]] = (t / 1e3, e.count)
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])
    total = sum(ms for ms, _ in rows.values())
    launches = sum(n for _, n in rows.values())
    print("KVX_PROFILE " + json.dumps({"model": a.model, "dtype": a.dtype, "batch": a.batch, "ctx": a.ctx,
                                        "steps": a.steps,
                                        "kernel_ms_total": round(total, 3), "launches_total": launches,
                                        # the profile covers `steps` decode steps and the one-token recompute
                                        "launches_per_step": round(launches / (a.steps + 1), 1),
                                        "layers": cfg["num_hidden_layers"],
                                        "top": [[k, round(ms, 3), n] for k, (ms, n) in top[:a.top]]}), flush=True)


if __name__ == "__main__":
    main()
