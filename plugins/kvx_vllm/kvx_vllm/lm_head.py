"""`--additional-config '{"kvx": {"lm_head": "mxfp4"}}'`: the output projection (lm_head) in MXFP4.

vLLM builds the head as `ParallelLMHead` with an unquantized method even when asked to quantize it online; KVX
registers an out-of-tree `ParallelLMHead` (vLLM's `PluggableLayer.register_oot`, vLLM 0.26 and 0.32) that, with the
option on, hands the head `Mxfp4HeadMethod`: after the weights load (and after a tied head shares the embedding's
weight), it quantizes its own MXFP4 copy with the formats' codec (`kvx_core.mxfp4_linear`: E2M1 + UE8M0 per 32
inputs, 4.25 bits per weight) and computes logits from it: on CUDA with vLLM's Marlin FP4 GEMM over that copy
(`marlin_head`: faster than KVX's kernel at every M measured) or, where vLLM has no FP4 Marlin, KVX's Triton kernel
(`kvx_core.ops.triton.mxfp4_gemv`); on CPU with the torch reference. A tied embedding keeps its BF16 weight; an
untied head's BF16 weight is freed once its copy exists (the memory goes to the KV cache). Without the option the
subclass does exactly what `ParallelLMHead` does.

Refused at model construction (ValueError naming the reason): GPUs other than NVIDIA Hopper (sm_90: verified there
only), LoRA and speculative decoding (both read the head's weight), a head dtype other than the
model's (`head_dtype` float32 would multiply the BF16 weight instead), and a head the checkpoint's quantization
config already quantizes. Accuracy is the user's call: on SmolLM2-135M's small tied head it is poor (docs/results.md
"MXFP4 lm_head").
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.platforms import current_platform

from kvx_core.errors import KvxError
from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4

from .marlin_head import marlin_mxfp4
from .options import options_of


class Mxfp4HeadMethod(UnquantizedEmbeddingMethod):
    """The head's quant method: BF16 weight loaded (and tied) as vLLM does, logits from its MXFP4 copy."""

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        layer.kvx_tied = True  # the weight is the embedding's: it must survive the quantization
        return super().tie_weights(layer, embed_tokens)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        try:
            q = quantize_mxfp4(layer.weight.data)
        except KvxError as e:
            raise ValueError(f"KVX lm_head mxfp4: {e}") from None
        # CUDA: vLLM's Marlin where it ships one (the faster kernel, KVX's codec), else KVX's kernel; CPU: reference
        layer.kvx_marlin = marlin_mxfp4(q, layer.weight.dtype)
        layer.kvx_mxfp4 = q if layer.kvx_marlin is None else None  # Marlin's repacked copy replaces the payload
        if not (getattr(layer, "kvx_tied", False) or layer.kvx_may_be_tied):
            w = layer.weight
            layer.weight = torch.nn.Parameter(w.data.new_empty((0, w.shape[1])), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = layer.kvx_marlin(x) if layer.kvx_marlin is not None else mxfp4_linear(x, layer.kvx_mxfp4)
        return out if bias is None else out + bias


def platform_refusal() -> str | None:
    """Why this platform cannot run the MXFP4 head (None when it can): CPU runs the torch reference, NVIDIA
    Hopper Marlin or KVX's kernel; other GPUs are not verified (KVX's bf16 decode uses sm_90 instructions)."""
    if current_platform.is_cpu():
        return None
    if current_platform.is_cuda():
        cap = current_platform.get_device_capability()
        if cap is not None and (cap.major, cap.minor) == (9, 0):
            return None
        sm = f"sm_{cap.major}{cap.minor}" if cap is not None else "unknown compute capability"
        return (f"GPU {current_platform.get_device_name()} ({sm}): KVX's MXFP4 head is verified on Hopper (sm_90) "
                "only")
    return f"platform {current_platform.device_name}: KVX's MXFP4 head runs on CPU and NVIDIA Hopper only"


def refusals(vllm_config, head: ParallelLMHead) -> list[str]:
    """Why the MXFP4 head cannot serve this run (empty when it can)."""
    out = [r for r in [platform_refusal()] if r]
    if vllm_config.lora_config is not None:
        out.append("LoRA reads the head's BF16 weight")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding reads the head's weight")
    model = vllm_config.model_config
    if model is not None and model.head_dtype != model.dtype:
        out.append(f"head_dtype {model.head_dtype} (the MXFP4 head computes in the model dtype {model.dtype})")
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
        model = vllm_config.model_config
        # A model may tie by assignment instead of tie_weights: then the BF16 weight is kept too.
        self.kvx_may_be_tied = bool(model is None or getattr(model.hf_text_config, "tie_word_embeddings", True))


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
