"""Test-only torch stand-in for TGI's Hub kernel `kernels-community/rotary` (see README.md)."""
import torch

from kvx_tgi.cpu_layers import rotated_halves


def apply_rotary(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out1: torch.Tensor,
                 out2: torch.Tensor, conj: bool) -> None:
    """`out1, out2 = x1 cos - x2 sin, x2 cos + x1 sin` (sin negated when `conj`); outputs may alias inputs."""
    y1, y2 = rotated_halves(x1, x2, cos, -sin if conj else sin)
    out1.copy_(y1)
    out2.copy_(y2)
