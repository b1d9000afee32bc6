"""vLLM's Marlin FP4 GEMM over a KVX MXFP4 weight: what the MXFP4 lm_head runs on CUDA where vLLM ships Marlin.

Marlin (`marlin_utils_fp4`, the W4A16 kernel of vLLM's MXFP4 linear layers) was measured faster than KVX's Triton
GEMV at every M on an H100 (`benchmarks/bench_lm_head.py`: 201088 x 2880 at M=1 190.8 vs 210.4 us, M=64 307 vs
358 us), computing the same logits (the same exact E2M1 x UE8M0 products; max difference 0.3% of the largest logit,
bf16 output rounding). KVX's weight is the OCP layout Marlin takes from MXFP4 checkpoints (element 2i in the low
nibble, one UE8M0 scale per 32 inputs), so Marlin repacks it as vLLM repacks a checkpoint's.
"""
from __future__ import annotations

import torch

from kvx_core.mxfp4_linear import Mxfp4Weight


class MarlinMxfp4:
    """`x [..., K] -> x @ W.T` by Marlin for one MXFP4 weight repacked once (the repacked copy replaces KVX's
    payload: the same 4.25 bits per weight)."""

    def __init__(self, weight: Mxfp4Weight, dtype: torch.dtype) -> None:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

        self.n, self.k = weight.out_features, weight.in_features
        self._layer = torch.nn.Module()  # the attributes vLLM's linear layers hand Marlin
        self._layer.output_size_per_partition, self._layer.input_size_per_partition = self.n, self.k
        self._layer.params_dtype = dtype
        self._layer.weight = torch.nn.Parameter(weight.payload, requires_grad=False)
        self._layer.weight_scale = torch.nn.Parameter(weight.scales, requires_grad=False)
        prepare_fp4_layer_for_marlin(self._layer)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._layer.weight, self._layer.weight_scale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

        layer = self._layer
        return apply_fp4_marlin_linear(x, layer.weight, layer.weight_scale, None, layer.workspace, self.n, self.k)


def marlin_mxfp4(weight: Mxfp4Weight, dtype: torch.dtype) -> MarlinMxfp4 | None:
    """Marlin for `weight` on its CUDA device, or None where vLLM has no FP4 Marlin for this GPU / dtype."""
    if not (weight.payload.is_cuda and dtype in (torch.bfloat16, torch.float16)):
        return None
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
    except ImportError:  # a vLLM without the module
        return None
    return MarlinMxfp4(weight, dtype) if is_fp4_marlin_supported() else None
