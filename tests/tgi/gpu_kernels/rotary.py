"""Test-only torch stand-in for TGI's Hub kernel `kernels-community/rotary` (see README.md)."""
import torch


def apply_rotary(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out1: torch.Tensor,
                 out2: torch.Tensor, conj: bool) -> None:
    """`out1, out2 = x1 cos - x2 sin, x2 cos + x1 sin` (sin negated when `conj`); outputs may alias inputs."""
    c, s = cos.float(), (-sin if conj else sin).float()
    f1, f2 = x1.float(), x2.float()
    y1, y2 = f1 * c - f2 * s, f2 * c + f1 * s
    out1.copy_(y1)
    out2.copy_(y2)
