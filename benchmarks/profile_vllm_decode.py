"""Where a vLLM decode step's GPU time goes, per KV cache dtype: CUDA kernel time by kernel over decode steps.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/profile_vllm_decode.py --dtype kvx_nvfp4 [--batch 64 --ctx 8192]
        [--model gemma3-27b-6l]   # a geometry of model_geometries.MODELS (Gemma 3: KVX 0.61-0.73x auto, B=1 x 32k)

`bench_vllm.py`'s model and settings, eager (CUPTI sees every kernel; kernel times do not depend on graphs), the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its kernels. The prompts
are cached first; the profile covers `--steps` decode steps (plus the one-token recompute of the cached prompts).
Prints one JSON line: per kernel (name cut to 90 characters) its total ms and calls, the step's total kernel ms,
the kernel launches in all and per step (the CUDA-graph node count of a step), and the model's layer count.

`--graphs`: the host side instead, as `bench_vllm.py` serves (full CUDA graphs for decode): the decode step's wall
time (the (1 + steps)-token pass less the 1-token pass, per step) and, per attention metadata builder class, its
`build` calls and host microseconds per step (every builder of the run timed: one per KV cache group, e.g. Gemma 3's
window and global layers): where a step whose kernels take as long as auto's spends its extra time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm import _prompts  # noqa: E402
from common import time_calls  # noqa: E402
from model_geometries import DEFAULT, MODELS, write_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--model", default=DEFAULT, choices=list(MODELS), help="model geometry (random weights)")
    ap.add_argument("--graphs", action="store_true", help="step wall time and builder host time under CUDA graphs")
    a = ap.parse_args()
    if a.graphs:
        return host_side(a)
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


def _time_builders(spent: dict[str, list[float]]) -> None:
    """Wrap `build` of every attention metadata builder class vLLM has imported so its calls and host seconds add
    to `spent[class name]`."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    def add(name: str, seconds: float) -> None:
        row = spent.setdefault(name, [0, 0.0])
        row[0], row[1] = row[0] + 1, row[1] + seconds

    todo, seen = list(AttentionMetadataBuilder.__subclasses__()), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if "build" in cls.__dict__:
            time_calls(cls, "build", lambda s, name=cls.__name__: add(name, s))


def host_side(a) -> None:
    """`--graphs`: decode step wall time and the metadata builders' host time per step (module doc)."""
    import time

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as model_dir:
        cfg = write_config(a.model, model_dir)
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  kv_cache_dtype=a.dtype, max_model_len=a.ctx + a.steps + 16, block_size=16,
                  gpu_memory_utilization=0.85, enable_prefix_caching=True, max_num_seqs=a.batch,
                  max_num_batched_tokens=16384, seed=0,
                  compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]})
        prompts = _prompts(a.batch, a.ctx, seed=1, vocab=cfg["vocab_size"])
        sp = lambda n: SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)  # noqa: E731
        llm.generate(prompts, sp(1), use_tqdm=False)  # caches the prompts
        spent: dict[str, list[float]] = {}
        _time_builders(spent)
        t = time.perf_counter()
        llm.generate(prompts, sp(1), use_tqdm=False)
        one = time.perf_counter() - t
        short = {k: list(v) for k, v in spent.items()}
        t = time.perf_counter()
        llm.generate(prompts, sp(1 + a.steps), use_tqdm=False)
        long = time.perf_counter() - t
    # `spent` holds both passes: the long one's builds less the short one's (its prefill-side step) -> decode steps
    per_step = {k: [n - 2 * short.get(k, [0, 0.0])[0], sec - 2 * short.get(k, [0, 0.0])[1]]
                for k, (n, sec) in spent.items()}
    print("KVX_PROFILE " + json.dumps({
        "model": a.model, "dtype": a.dtype, "batch": a.batch, "ctx": a.ctx, "steps": a.steps, "graphs": True,
        "step_ms": round((long - one) * 1e3 / a.steps, 3),
        "builders": {k: {"calls_per_step": round(n / a.steps, 2), "host_us_per_step": round(s * 1e6 / a.steps, 1)}
                     for k, (n, s) in per_step.items()},
        "builder_us_per_step": round(sum(s for _, s in per_step.values()) * 1e6 / a.steps, 1)}), flush=True)


if __name__ == "__main__":
    main()
