"""vLLM time per output token with KVX's MXFP4 lm_head on and off (`--additional-config '{"kvx": {"lm_head":
"mxfp4"}}'`), one process per setting on one GPU, batch 1 / 4 / 16.

    python benchmarks/bench_vllm_lm_head.py --out benchmarks/results/vllm_lm_head_mxfp4_h100.jsonl

Model: a random-weight dense Llama shaped to read what gpt-oss-20b reads per decode step (`load_format="dummy"`, no
tokenizer): gpt-oss-20b's hidden 2880, vocab 201088 with an untied head, 24 layers, attention 64 query / 8 KV heads
of 64; its MoE (4 active experts of 2880 x 2880 x 3 in MXFP4, ~53 MB per layer) replaced by a BF16 MLP of the same
bytes (intermediate 3072). Per step: ~2.55 GB of layers + the 1.16 GB BF16 head, so the head is ~31% of the bytes
and the MXFP4 head (0.31 GB) bounds the step's speed-up near 1.3x at batch 1. Not gpt-oss itself: its MoE kernels
and attention sinks are not part of what is measured here.

Settings (both runs): bf16, max_model_len 2048, prefix caching, decode in full CUDA graphs (FULL_DECODE_ONLY,
capture sizes 1..16) without torch.compile (`mode=0`; vLLM computes logits outside the graphs either way). Per
batch B: 512-token random prompts cached first, then time per output token = (wall time of 1 + S tokens - wall time
of 1 token) / S (`bench_vllm._decode`), the median of 3 such measurements (all 3 recorded). The child also reports KV
capacity (an untied head's freed BF16 weight goes to the KV cache) and what the head is (its method and BF16 weight
size, read through `LLM.apply_model`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vllm import _decode, _prompts  # noqa: E402

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2880,
         "intermediate_size": 3072, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
         "head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 4096, "rope_theta": 150000.0,
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}
BATCHES, PROMPT, REPEATS = (1, 4, 16), 512, 3
MODES = ("none", "mxfp4")


def _head(model) -> dict:
    head = model.lm_head
    kernel = next((k for k in ("kvx_marlin", "kvx_mxfp4") if getattr(head, k, None) is not None), None)
    return {"method": type(head.quant_method).__name__, "bf16_weight_numel": head.weight.numel(),
            "kernel": kernel, "mxfp4_bytes": getattr(head, kernel).nbytes if kernel else None}


def run_one(mode: str, out: str | None, steps: int) -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # `apply_model(_head)` pickles the function to the engine
    import vllm
    from common import emit, env_info
    from vllm import LLM

    base = {**env_info(), "bench": "vllm_lm_head", "vllm": vllm.__version__, "lm_head": mode,
            "model": "gpt-oss-20b-shaped dense Llama (random)"}
    extra = {"kvx": {"lm_head": mode}} if mode != "none" else {}
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL, f)
        t0 = time.perf_counter()
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=2048, gpu_memory_utilization=0.5, enable_prefix_caching=True,
                  max_num_seqs=max(BATCHES), seed=0, additional_config=extra,
                  compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
        cc = llm.llm_engine.vllm_config.cache_config
        emit(out, {**base, "metric": "setup", "kv_tokens": cc.num_gpu_blocks * cc.block_size,
                   "startup_s": round(time.perf_counter() - t0, 1), "head": llm.apply_model(_head)[0]})
        for b in BATCHES:
            prompts = _prompts(b, PROMPT, seed=b, vocab=MODEL["vocab_size"])
            runs = [1e3 * _decode(llm, prompts, steps)["decode_s"] / steps for _ in range(REPEATS)]
            emit(out, {**base, "metric": "decode", "batch": b, "ctx": PROMPT, "steps": steps,
                       "tpot_ms_runs": [round(t, 3) for t in runs], "tpot_ms": round(statistics.median(runs), 3)})


def summarize(path: str) -> str:
    """Markdown: time per output token per batch with the head off / on, and the ratio, from one results file."""
    tpot: dict[tuple[str, int], float] = {}
    kv: dict[str, int] = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("metric") == "decode":
            tpot[(r["lm_head"], r["batch"])] = r["tpot_ms"]
        elif r.get("metric") == "setup":
            kv[r["lm_head"]] = r["kv_tokens"]
    out = ["| batch | BF16 head ms/token | MXFP4 head ms/token | speed-up |", "|---|---|---|---|"]
    for b in BATCHES:
        off, on = tpot.get(("none", b)), tpot.get(("mxfp4", b))
        if off and on:
            out.append(f"| {b} | {off:.3f} | {on:.3f} | {off / on:.2f}x |")
    if len(kv) == 2:
        out.append(f"\nKV tokens at gpu_memory_utilization 0.5: {kv['none']:,} (BF16 head) -> {kv['mxfp4']:,} (MXFP4)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--steps", type=int, default=256, help="decode steps timed per batch")
    ap.add_argument("--timeout-s", type=int, default=300, help="limit per process")
    ap.add_argument("--summarize", metavar="JSONL", help="print the markdown table of a results file and exit")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args()
    if a.summarize:
        print(summarize(a.summarize))
        return
    if a.one:
        run_one(a.one, a.out, a.steps)
        return
    from common import run_per_process

    run_per_process(os.path.abspath(__file__), list(MODES), ["--steps", str(a.steps)], a.out, a.timeout_s)

if __name__ == "__main__":
    main()
