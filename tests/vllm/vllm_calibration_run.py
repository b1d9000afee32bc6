"""One vLLM instance (CPU, SmolLM2-135M) serving a KV-cache calibration file; prints one JSON line.

    python tests/vllm/vllm_calibration_run.py MODEL_DIR CACHE_DTYPE PREFILL PROMPT_IDS_JSON    (PREFILL: split, cache)

MODEL_DIR holds `kvx_kv_calibration.kvx` (found there, no option). One greedy request over the given prompt
token ids, prefilled in chunks of `CHUNK` tokens (split prefill: each chunk over its own exact K/V plus the cached,
calibrated prefix; cache prefill: everything over the pages) then decoded for `GEN` tokens, returns the prompt's top-5
log-probabilities at every position and each generated token with its log-probability. `LLM.apply_model` reports, per
attention layer, how far the CacheDesc the backend built lies from the file's values for this format (key smoothing, key
centering, K / V global scales).
"""
from __future__ import annotations

import json
import sys

CHUNK = 128
GEN = 16


_MODEL: list[str] = []  # the model dir (the engine runs in this process: 'uni' executor, no multiprocessing)


def inspect(model) -> list[dict]:
    """Per KVX attention layer: max |CacheDesc value - file value| of the smoothing, the centering (None: neither
    has one, inf: only one has) and the global scales."""
    import torch
    from vllm.model_executor.models.utils import extract_layer_index

    from kvx_core.kv_calibration import FILENAME, load_kv_calibration
    from kvx_vllm.backend import KvxAttentionImpl

    cal = load_kv_calibration(f"{_MODEL[0]}/{FILENAME}")
    out = []
    for m in model.modules():
        impl = getattr(m, "impl", None)
        if not isinstance(impl, KvxAttentionImpl):
            continue
        q = impl._desc[1].quant
        i = extract_layer_index(m.layer_name)
        s, c, k, v = cal.for_format(impl.format)[i]
        center_diff = None if c is None and q.k_center is None else float("inf") if c is None or q.k_center is None \
            else float((q.k_center.cpu() - c).abs().max())
        out.append({"layer": i, "format": impl.format.name, "center_diff": center_diff,
                    "centered": c is not None and bool(torch.any(c != 0)),
                    "smoothing_diff": float((q.k_smoothing.cpu() - s).abs().max()),
                    "k_global_diff": float((q.k_global_scale.cpu() - k).abs().max()),
                    "v_global_diff": float((q.v_global_scale.cpu() - v).abs().max()),
                    "k_global_shape": list(q.k_global_scale.shape), "smoothed": bool(torch.any(s != 1))})
    return sorted(out, key=lambda r: r["layer"])


def main(model_dir: str, cache_dtype: str, prefill: str, prompt_ids: list[int]) -> dict:
    from vllm import LLM, SamplingParams

    _MODEL.append(model_dir)
    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=512, enforce_eager=True,
              max_num_seqs=1, max_num_batched_tokens=CHUNK, enable_prefix_caching=False, seed=0,
              distributed_executor_backend="uni", additional_config={"kvx": {"prefill": prefill}})
    res = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, prompt_logprobs=5, logprobs=1),
                       use_tqdm=False)[0]
    o = res.outputs[0]
    return {"layers": llm.apply_model(inspect)[0],
            "prompt_logprobs": [None if lp is None else sorted((k, v.logprob) for k, v in lp.items())
                                for lp in res.prompt_logprobs],
            "generated": [[t, lp[t].logprob] for t, lp in zip(o.token_ids, o.logprobs, strict=True)]}


if __name__ == "__main__":
    print("KVX_RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))), flush=True)
