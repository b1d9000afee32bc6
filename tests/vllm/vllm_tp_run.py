"""One vLLM instance (CPU) of a model at a given tensor-parallel size; prints one JSON line.

    python tests/vllm/vllm_tp_run.py MODEL_DIR CACHE_DTYPE TP PROMPTS_JSON [KVX_OPTIONS_JSON]
    python tests/vllm/vllm_tp_run.py --runs RUNS_JSON    (a list of [MODEL_DIR, CACHE_DTYPE, TP, PROMPTS, KVX_OPTIONS])

`distributed_executor_backend="mp"` (one worker process per rank; TP=1 too, so both runs take the same path) and
no tokenizer (`skip_tokenizer_init`: PROMPTS_JSON is a list of token-id lists). The prompts run together, greedy
(chunked prefill and batched decode); per request, its top-5 log-probabilities at every prompt position and at each
of `GEN` generated tokens, with the token chosen. `LLM.apply_model` reports, per rank and
attention layer, the KV heads the backend serves and the key smoothing, key centering and global scales its
CacheDesc holds (the calibration's values where MODEL_DIR has a file), so the test can compare them with the file's
rows of that rank's heads. KVX_OPTIONS_JSON: the run's `--additional-config` "kvx" options (e.g. {"lm_head": "mxfp4"}).
`KVX_TP_RUN_GRAPHS=1` (the GPU runs): the decode steps replay full CUDA graphs (`FULL_DECODE_ONLY`, no torch.compile,
as benchmarks/bench_vllm.py serves), instead of eager mode.
`KVX_TP_RUN_KV={"role": ROLE, "store": DIR}`: the instance runs `KvxConnector` on the store DIR (prefix caching on, no
prompt log-probabilities: vLLM computes those only for prompts it prefills itself). A `kv_producer` prefills every
prompt (one output token), which stores its KV; a `kv_consumer` takes each prompt alone to its first output token with
the KV loaded from the store, then computing the prompt itself (`skip_reading_prefix_cache`): wall times, cached
tokens and the first token's top-20 log-probabilities of both. `{"role": ROLE, "nixl": true}`: the NIXL transport
instead of a store, both instances running at once: the producer marks its prompts `do_remote_decode`, prints
"KVX_PARAMS <json>" (their returned `kv_transfer_params`: the tickets) and keeps them published until a line arrives
on stdin; the consumer reads that line (a P/D proxy's part) and hands each prompt its ticket.
`--runs`: the runs one after another in this process, each engine shut down (its workers, its distributed state)
before the next starts; one JSON line of their results in order. The process imports vLLM once instead of once per
run (~8 s of a ~25 s run on 2 CPU cores); the workers are still spawned per run.
"""
from __future__ import annotations

import json
import os
import sys

GEN = 16


def inspect(model) -> dict:
    """This rank's TP rank and, per KVX attention layer, its KV head count and the bound calibration values."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.models.utils import extract_layer_index

    from kvx_vllm.backend import KvxAttentionImpl

    layers = []
    for m in model.modules():
        impl = getattr(m, "impl", None)
        if isinstance(impl, KvxAttentionImpl):
            q = impl._desc[1].quant
            layers.append({"layer": extract_layer_index(m.layer_name), "num_kv_heads": impl.num_kv_heads,
                           **{name: None if t is None else t.cpu().tolist()
                              for name, t in (("k_smoothing", q.k_smoothing), ("k_center", q.k_center),
                                              ("k_global", q.k_global_scale), ("v_global", q.v_global_scale))}})
    return {"rank": get_tensor_model_parallel_rank(), "layers": sorted(layers, key=lambda r: r["layer"])}


def _top(lp: dict | None) -> list | None:
    return None if lp is None else sorted([k, v.logprob] for k, v in lp.items())


def _inspected(llm, graphs: bool) -> dict:
    """Each rank's `inspect` (after the first step: the backend binds its layers' caches then), the KV blocks."""
    from tests.vllm.vllm_tp_run import inspect as by_name  # pickled by module name: workers import it

    return {"ranks": sorted(llm.apply_model(by_name), key=lambda r: r["rank"]), "cuda_graphs": graphs,
            "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}


def _handoff(llm, prompts: list[list[int]], role: str, nixl: bool) -> dict:
    """The producer's prompt lengths, or per prompt the consumer's handed-over and local first token."""
    import time

    from vllm import SamplingParams

    if role == "kv_producer":
        extra = {"extra_args": {"kv_transfer_params": {"do_remote_decode": True}}} if nixl else {}
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **extra), use_tqdm=False)
        if nixl:
            print("KVX_PARAMS " + json.dumps([r.kv_transfer_params for r in outs]), flush=True)
            sys.stdin.readline()  # the bundles stay published until the consumer is done
        return {"produced": [len(r.prompt_token_ids) for r in outs]}
    tickets = json.loads(sys.stdin.readline()) if nixl else [None] * len(prompts)
    # warm up (kernels, graphs, the first step's allocations) on a prompt the store does not hold
    llm.generate([{"prompt_token_ids": list(range(1, 33))}], SamplingParams(max_tokens=2, detokenize=False),
                 use_tqdm=False)
    rows = []
    for ids, ticket in zip(prompts, tickets, strict=True):
        row = {}
        handed = {"extra_args": {"kv_transfer_params": ticket}} if ticket else {}
        for how, extra in (("handoff", handed), ("local", {"skip_reading_prefix_cache": True})):
            t0 = time.perf_counter()
            r = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                                                         detokenize=False, **extra),
                             use_tqdm=False)[0]
            row[how] = {"seconds": round(time.perf_counter() - t0, 4), "prompt_tokens": len(ids),
                        "cached": r.num_cached_tokens, "first": _top(r.outputs[0].logprobs[0])}
        rows.append(row)
    return {"consumed": rows}


def main(model_dir: str, cache_dtype: str, tp: int, prompts: list[list[int]], kvx: dict) -> dict:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships `inspect` to the workers by pickle
    from vllm import LLM

    graphs = os.environ.get("KVX_TP_RUN_GRAPHS") == "1"
    mode = ({"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": [1, 2, 4]}} if graphs else {"enforce_eager": True})
    kv = json.loads(os.environ.get("KVX_TP_RUN_KV", "null"))
    if kv:
        import vllm

        policy = "fail" if vllm.__version__.startswith("0.26") else "recompute"  # as vllm_pd_run.py
        mode.update(kv_transfer_config={"kv_connector": "KvxConnector", "kv_role": kv["role"],
                                        "kv_load_failure_policy": policy})
        kvx = {**kvx, **({"transport": "nixl", "nixl_buffer": "64MiB", "nixl_slots": 8, "nixl_hold_s": 600}
                         if kv.get("nixl") else {"store": kv["store"]})}
    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=256, **mode,
              max_num_seqs=len(prompts), max_num_batched_tokens=64, enable_prefix_caching=bool(kv), seed=0,
              skip_tokenizer_init=True, tensor_parallel_size=tp, distributed_executor_backend="mp",
              additional_config={"kvx": kvx})
    out = _handoff(llm, prompts, kv["role"], bool(kv.get("nixl"))) if kv else {"requests": _requests(llm, prompts)}
    out = {**out, **_inspected(llm, graphs)}  # after the requests: the layers bind their caches at the first step
    llm.llm_engine.engine_core.shutdown()
    return out


def _requests(llm, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: the top-5 log-probabilities at every prompt position and each generated token with its top-5."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, prompt_logprobs=5, logprobs=5,
                                       detokenize=False), use_tqdm=False)
    return [{"prompt_logprobs": [_top(lp) for lp in r.prompt_logprobs],
             "generated": [[t, _top(lp)] for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs, strict=True)]}
            for r in outs]


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        res = [main(*run) for run in json.loads(sys.argv[2])]
    else:
        res = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]),
                   json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})
    print("KVX_RESULT " + json.dumps(res), flush=True)
