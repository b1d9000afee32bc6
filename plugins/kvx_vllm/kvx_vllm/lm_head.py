"""`--additional-config '{"kvx": {"lm_head": "mxfp4"}}'`: the output projection (lm_head) in MXFP4.

vLLM builds the head as `ParallelLMHead` with an unquantized method even when asked to quantize it online; KVX
registers an out-of-tree `ParallelLMHead` (vLLM's `PluggableLayer.register_oot`) that, with the option on, hands the
head `Mxfp4HeadMethod`: after the weights load (and after a tied head shares the embedding's weight), it quantizes
its own MXFP4 copy with the formats' codec (`kvx_core.mxfp4_linear`: E2M1 + UE8M0 per 32 inputs, 4.25 bits per
weight) and computes logits from it; the embedding keeps its BF16 weight. Without the option the subclass does
exactly what `ParallelLMHead` does.

Refused at model construction (ValueError naming the reason): a CUDA / ROCm / XPU platform (the CUDA kernel
`kvx_core.ops.triton.mxfp4_gemv` exists and is tested on its own, but this option has not been run inside vLLM on a
GPU yet), LoRA and
speculative decoding (both read the head's weight), and a head the checkpoint's quantization config already
quantizes. Accuracy is the user's call: on SmolLM2-135M's small tied head it is poor (README "MXFP4 lm_head").
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.platforms import current_platform

from kvx_core.errors import KvxError
from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4

from .options import options_of


class Mxfp4HeadMethod(UnquantizedEmbeddingMethod):
    """The head's quant method: BF16 weight loaded (and tied) as vLLM does, logits from its MXFP4 copy."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        try:
            layer.kvx_mxfp4 = quantize_mxfp4(layer.weight.data)
        except KvxError as e:
            raise ValueError(f"KVX lm_head mxfp4: {e}") from None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = mxfp4_linear(x, layer.kvx_mxfp4)
        return out if bias is None else out + bias


def refusals(vllm_config, head: ParallelLMHead) -> list[str]:
    """Why the MXFP4 head cannot serve this run (empty when it can)."""
    out = []
    if not current_platform.is_cpu():
        out.append(f"platform {current_platform.device_name}: not verified inside vLLM on a GPU yet (KVX's MXFP4 "
                   "kernel is tested on its own; the option runs on vLLM's CPU platform)")
    if vllm_config.lora_config is not None:
        out.append("LoRA reads the head's BF16 weight")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding reads the head's weight")
    if not isinstance(head.quant_method, UnquantizedEmbeddingMethod):
        out.append(f"the checkpoint's quantization already sets the head's method ({type(head.quant_method).__name__})")
    return out


class KvxParallelLMHead(ParallelLMHead):
    """`ParallelLMHead`, with the MXFP4 method when `--additional-config '{"kvx": {"lm_head": "mxfp4"}}'`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        if options_of(vllm_config).lm_head != "mxfp4":
            return
        reasons = refusals(vllm_config, self)
        if reasons:
            raise ValueError("KVX lm_head mxfp4 cannot be used with: " + "; ".join(reasons))
        self.quant_method = Mxfp4HeadMethod()


def install() -> None:
    """Make vLLM build its heads as `KvxParallelLMHead` (`register_oot`, vLLM 0.32). A vLLM whose `ParallelLMHead`
    is not pluggable gets a constructor check instead that refuses the option, so it is never silently ignored."""
    if hasattr(ParallelLMHead, "register_oot"):
        ParallelLMHead.register_oot(KvxParallelLMHead)
        return
    plain_init = ParallelLMHead.__init__

    def init(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        if options_of(get_current_vllm_config()).lm_head is not None:
            raise ValueError("KVX lm_head: this vLLM's ParallelLMHead cannot be replaced by a plugin (no register_oot)")

    ParallelLMHead.__init__ = init
