"""Rotary position embedding removed from keys before KVTC codes them (and put back after), as the KVTC paper does:
post-RoPE keys carry a position-dependent rotation that spreads them over more principal components.

The rotation is Llama's "rotate_half" RoPE with the default frequencies: dim pairs (i, i + D/2), angle
`pos * theta^(-2i/D)`. Only that form is served (`rope_type: default`); models with scaled or partial rotary
embeddings calibrate without removal. In float32: removal and re-application are inverse up to float rounding, which
the codec's quantization error dwarfs; raw tokens are never rotated.
"""
from __future__ import annotations

import torch


def rotate(keys: torch.Tensor, positions: torch.Tensor, theta: float, *, inverse: bool = False) -> torch.Tensor:
    """`keys [T, H, D]` rotated by the RoPE angles of `positions [T]` (by minus them with `inverse`), float32."""
    d = keys.shape[-1]
    half = d // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64, device=keys.device) * 2 / d)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]  # [T, D/2]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    if inverse:
        sin = -sin
    x = keys.float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_theta_of(config) -> float | None:
    """The RoPE base of a transformers config when its rotary embedding is the default full-width form, else None."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and params.get("rope_type", "default") != "default":
        return None
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return None
    theta = params.get("rope_theta") if params else None
    return float(theta if theta is not None else getattr(config, "rope_theta", None) or 0) or None
