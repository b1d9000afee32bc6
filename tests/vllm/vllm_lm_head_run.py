"""One vLLM instance (CPU, or CUDA on the GPU machine; SmolLM2-135M) with
`--additional-config '{"kvx": {"lm_head": MODE}}'`; prints one JSON line.

    python tests/vllm/vllm_lm_head_run.py CKPT MODE     (MODE: mxfp4 or none)

Scores PROMPTS (prompt_logprobs: the top-5 log-probabilities at every prompt position) and inspects the loaded
model through `LLM.apply_model`: the head's method, whether its MXFP4 copy equals the formats' codec of the
embedding weight (on CUDA with Marlin: how far Marlin's logits of 8 random rows are from the codec's reference
product), and whether the embedding kept its BF16 weight.
"""
from __future__ import annotations

import json
import sys

PROMPTS = ["The lighthouse keeper wrote in his journal that the ship had", "def fibonacci(n):\n    return"]


def inspect(model) -> dict:
    import torch

    from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4

    head, embed = model.lm_head, model.model.embed_tokens
    out = {"method": type(head.quant_method).__name__, "tied": head.weight is embed.weight,
           "embed_dtype": str(embed.weight.dtype)}
    if getattr(head, "kvx_marlin", None) is not None:  # CUDA: Marlin's repacked copy of the codec's weight
        ref = quantize_mxfp4(embed.weight.data)
        g = torch.Generator(device=embed.weight.device).manual_seed(0)
        x = torch.randn(8, ref.in_features, generator=g, device=embed.weight.device).to(embed.weight.dtype)
        want = mxfp4_linear(x, ref, backend="torch").float()
        out["kernel"] = "marlin"
        out["marlin_rel_diff"] = float((head.kvx_marlin(x).float() - want).abs().max() / want.abs().max())
    elif getattr(head, "kvx_mxfp4", None) is not None:
        ref = quantize_mxfp4(embed.weight.data)
        out["kernel"] = "kvx" if ref.payload.is_cuda else "reference"
        out["codec_equal"] = bool(torch.equal(head.kvx_mxfp4.payload, ref.payload)
                                  and torch.equal(head.kvx_mxfp4.scales, ref.scales))
    return out


def main(ckpt: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams

    extra = {"kvx": {"lm_head": mode}} if mode != "none" else {}
    llm = LLM(model=ckpt, dtype="bfloat16", max_model_len=512, enforce_eager=True, max_num_seqs=2, seed=0,
              distributed_executor_backend="uni", additional_config=extra)
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5), use_tqdm=False)
    return {"model": llm.apply_model(inspect)[0],
            "prompts": [{"ids": list(r.prompt_token_ids),
                         "logprobs": [None if lp is None else sorted((k, v.logprob) for k, v in lp.items())
                                      for lp in r.prompt_logprobs]} for r in res]}


if __name__ == "__main__":
    print("KVX_RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
