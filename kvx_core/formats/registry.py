"""Cache-level formats: the (K format, V format, rotation) triple behind each KVX cache format name.

Rotation (`_rot` names, FP4/INT4 only) applies to BOTH keys and values, as the descriptor's single
`QUANT_FLAG_HADAMARD` says: Q and K are rotated by the same H (Q K^T unchanged), V is rotated at write
time and the attention output is rotated back. For `k8v4_rot` the FP8 keys are rotated too (harmless
for FP8, and it keeps one flag meaning one thing for every reader).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..enums import QUANT_FLAG_HADAMARD, QUANT_FLAG_MX_SCALE_FLOOR, QuantFormat
from ..errors import KvxError, Status
from .base import TensorFormat, check_out_dtype
from .fp8 import FP8Format
from .identity import IdentityFormat
from .integer import IntFormat
from .mxfp4 import MXFP4Format
from .nvfp4 import NVFP4Format
from .rotation import hadamard, rotate


@dataclass(frozen=True)
class CacheFormat:
    """A named KVX cache format: how K and V are stored and whether they are Hadamard-rotated."""

    name: str
    k: TensorFormat
    v: TensorFormat
    rotate: bool = False

    @property
    def quant(self) -> QuantFormat:
        """The `kvx_quant_format_t` recorded in the quantization descriptor."""
        if self.k.quant == QuantFormat.FP8_E4M3 and self.v.quant == QuantFormat.NVFP4:
            return QuantFormat.K8V4
        return self.k.quant

    @property
    def uses_global_scale(self) -> bool:
        """Whether K or V takes a per-layer FP32 global scale (fp8_*, nvfp4, k8v4 and their `_rot` variants)."""
        return self.k.uses_global_scale or self.v.uses_global_scale

    @property
    def flags(self) -> int:
        """Quantization descriptor flags: `QUANT_FLAG_HADAMARD` when rotated, `QUANT_FLAG_MX_SCALE_FLOOR`
        when MXFP4 scales use the OCP FLOOR rule."""
        floor = any(getattr(t, "scale_rule", "rceil") == "floor" for t in (self.k, self.v))
        return (QUANT_FLAG_HADAMARD if self.rotate else 0) | (QUANT_FLAG_MX_SCALE_FLOOR if floor else 0)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise KvxError unless both tensors (and the rotation) support `head_dim`."""
        self.k.check_head_dim(head_dim)
        self.v.check_head_dim(head_dim)
        if self.rotate:
            hadamard(head_dim)

    def bytes_per_token_head(self, head_dim: int) -> float:
        """Bytes of K plus V (payload + scale pool) for one (token, KV head)."""
        self.check_head_dim(head_dim)
        return self.k.bytes_per_token_head(head_dim) + self.v.bytes_per_token_head(head_dim)

    # Reference write/read helpers: rotation + per-tensor codec.
    def rotate_q(self, q: Tensor) -> Tensor:
        """Queries as the attention kernel must see them (rotated iff the keys are)."""
        return rotate(q) if self.rotate else q

    def encode_k(self, k: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """Keys `[..., H, D]` -> (payload, scales), rotating first when the format says so."""
        return self.k.encode(rotate(k) if self.rotate else k, global_scale)

    def encode_v(self, v: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """Values `[..., H, D]` -> (payload, scales), rotating first when the format says so."""
        return self.v.encode(rotate(v) if self.rotate else v, global_scale)

    def decode_k(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
                 out_dtype: torch.dtype = torch.float32) -> Tensor:
        """Stored keys -> keys in the (possibly rotated) domain that `rotate_q` queries live in."""
        return self.k.decode(payload, scales, global_scale, out_dtype)

    def decode_v(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
                 out_dtype: torch.dtype = torch.float32, unrotate: bool = False) -> Tensor:
        """Stored values; `unrotate=True` maps them back to the model's domain (else use `unrotate_output`)."""
        check_out_dtype(out_dtype)
        if not isinstance(unrotate, bool):
            raise KvxError(Status.INVALID_ARGUMENT, f"unrotate must be a bool, got {unrotate!r}")
        v = self.v.decode(payload, scales, global_scale, torch.float32)
        return (rotate(v) if (self.rotate and unrotate) else v).to(out_dtype)

    def unrotate_output(self, o: Tensor) -> Tensor:
        """Attention output computed from rotated values -> the model's domain (H^-1 = H)."""
        return rotate(o) if self.rotate else o


def _build() -> dict[str, CacheFormat]:
    bf16, fp16, fp32 = IdentityFormat("bf16"), IdentityFormat("fp16"), IdentityFormat("fp32")
    e4m3, e5m2 = FP8Format("fp8_e4m3"), FP8Format("fp8_e5m2")
    int8, int4 = IntFormat(8), IntFormat(4)
    mx16, mx32 = MXFP4Format(16, "rceil"), MXFP4Format(32, "rceil")
    mx16f, mx32f = MXFP4Format(16, "floor"), MXFP4Format(32, "floor")
    nv = NVFP4Format()
    plain = {
        "bf16": (bf16, bf16), "fp16": (fp16, fp16), "fp32": (fp32, fp32),
        "fp8_e4m3": (e4m3, e4m3), "fp8_e5m2": (e5m2, e5m2),
        "int8": (int8, int8), "int4": (int4, int4),
        "mxfp4": (mx16, mx16), "mxfp4_32": (mx32, mx32), "nvfp4": (nv, nv),
        "mxfp4_floor": (mx16f, mx16f), "mxfp4_32_floor": (mx32f, mx32f),
        "k8v4": (e4m3, nv),
    }
    out = {name: CacheFormat(name, k, v, False) for name, (k, v) in plain.items()}
    for base in ("int4", "mxfp4", "mxfp4_32", "nvfp4", "k8v4"):
        k, v = plain[base]
        out[base + "_rot"] = CacheFormat(base + "_rot", k, v, True)
    return out


_FORMATS = _build()

#: The formats the engine plugins offer as cache dtypes (vLLM's `--kv-cache-dtype kvx_<name>`; their `_rot` variants
#: through the plugin's rotate option). A format added here is served with no plugin change.
ENGINE_SERVED: tuple[str, ...] = ("nvfp4", "mxfp4", "int4", "int8", "k8v4")


def list_formats() -> list[str]:
    """Every KVX cache format name, in registry order."""
    return list(_FORMATS)


def get_format(name: str) -> CacheFormat:
    """The cache format called `name`; KvxError(UNSUPPORTED) listing the valid names otherwise."""
    fmt = _FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise KvxError(Status.UNSUPPORTED,
                       f"unknown KVX cache format {name!r}; valid names: {', '.join(_FORMATS)}")
    return fmt
