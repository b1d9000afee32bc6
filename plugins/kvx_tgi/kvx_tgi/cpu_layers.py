"""Torch rotary embedding and norms for TGI on a plain CPU (`SYSTEM == "cpu"`), and its CPU device choice.

Scope: CPU only. TGI implements these layers with CUDA / ROCm / IPEX kernels and raises on a plain CPU
(`PositionRotaryEmbedding.forward`, `FastRMSNorm.forward`; `FastLayerNorm` is not even defined), and
`FlashCausalLM` takes a CPU device only under IPEX. `enable()` fills exactly those gaps, so TGI's own
model files, batching and gRPC service run on CPU (CI) with KVX caches:
- rotary: TGI's NeoX-style in-place rotation of `q`/`k` with its own `cos`/`sin` (`[T, 1, rot/2]`);
- RMSNorm / LayerNorm: TGI's fused "add residual, then normalise" contract `(x, residual) -> (y, x + residual)`,
  computed in fp32 and cast back as TGI's own wide-hidden torch path does;
- device: `flash_causal_lm`'s module-level `SYSTEM` reads "ipex" so `FlashCausalLM.__init__` takes its CPU
  branch (device cpu, default dtype bfloat16). The module's other `SYSTEM` tests are ROCm-only, and IPEX's
  thread pinning there is a no-op without the `numa` package. Nothing else sees the change.
"""
from __future__ import annotations

import torch
from torch import nn


def rotated_halves(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotation of the halves `(x1, x2)` in fp32: `(x1 cos - x2 sin, x2 cos + x1 sin)` (new tensors)."""
    c, s = cos.float(), sin.float()
    f1, f2 = x1.float(), x2.float()
    return f1 * c - f2 * s, f2 * c + f1 * s


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dim, in fp32."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: the halves of the first `2 * rot` dims of `x` (`rot = cos.shape[-1]`) rotated."""
    r = cos.shape[-1]
    x1, x2 = x[..., :r], x[..., r:2 * r]
    y1, y2 = rotated_halves(x1, x2, cos, sin)
    x1.copy_(y1)
    x2.copy_(y2)


def rotary_forward(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`PositionRotaryEmbedding.forward` for CPU: rotates `query` and `key` in place."""
    _rotate(query, cos, sin)
    _rotate(key, cos, sin)


def _add_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else x + residual


def rms_norm_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
    """`FastRMSNorm.forward` for CPU: `(weight * rmsnorm(x + residual), x + residual)`."""
    x = _add_residual(hidden_states, residual)
    return self.weight * rms_normalized(x, self.variance_epsilon).to(self.weight.dtype), x


class CpuFastLayerNorm(nn.LayerNorm):
    """`FastLayerNorm` for CPU (TGI defines it for CUDA/ROCm/IPEX only): `(layernorm(x + residual), x + residual)`."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        x = _add_residual(hidden_states, residual)
        return super().forward(x), x


def enable() -> None:
    """Fill TGI's CPU gaps (call before TGI's model modules are imported; `install` does)."""
    from text_generation_server.layers import layernorm, rotary

    rotary.PositionRotaryEmbedding.forward = rotary_forward
    layernorm.FastRMSNorm.forward = rms_norm_forward
    if not hasattr(layernorm, "FastLayerNorm"):
        layernorm.FastLayerNorm = CpuFastLayerNorm


def enable_device() -> None:
    """Let `FlashCausalLM` take its CPU branch (after `text_generation_server.models` is imported)."""
    from text_generation_server.models import flash_causal_lm

    flash_causal_lm.SYSTEM = "ipex"

