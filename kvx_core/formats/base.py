"""`TensorFormat`: how ONE cache tensor (K or V) is stored, with its exact torch encode/decode.

Every format maps `x[..., H, D]` (FP16/BF16/FP32/FP64) to a payload tensor
`[..., H, payload_dim(D)]` of the format's storage dtype and a scale-pool tensor
`uint8[..., H, scale_dim(D)]` (last dim 0 for formats without a scale pool), and back.
The FP32 `global_scale` (shape `[]` per tensor or `[H]` per KV head, broadcast over axis -2) is a
descriptor-level parameter, never stored in the scale pool.
Quantized formats compute in FP32: finite FP64 inputs beyond the FP32 range first saturate to
+-FP32 max (`to_f32_saturated`), so a finite input never encodes as NaN; the identity formats store
torch's IEEE cast instead (see identity.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ..enums import DType, QuantFormat, ScaleGranularity, torch_dtype
from ..errors import KvxError, Status
from .kernel_facts import KernelFormat

#: `group_size` value of formats whose scale covers a whole (token, KV head) row of head_dim values.
GROUP_HEAD_DIM = -1
#: Largest finite FP32 value: finite inputs beyond it (FP64 only) saturate to it before encoding.
F32_MAX = torch.finfo(torch.float32).max


def to_f32_saturated(x: Tensor) -> Tensor:
    """`x` in FP32, finite values beyond the FP32 range (possible in FP64 input) saturated to +-F32_MAX
    rather than cast to +-inf, so a finite input never reaches a format as a non-finite value.
    NaN and +-inf are kept; tiny values round to FP32 subnormals or zero as the cast does."""
    if x.dtype == torch.float64:
        x = torch.where(torch.isfinite(x), x.clamp(-F32_MAX, F32_MAX), x)
    return x.to(torch.float32)


class TensorFormat(ABC):
    """Storage of one cache tensor (K or V): payload + per-token-head scale bytes + optional global scale."""

    name: str
    quant: QuantFormat
    data_dtype: DType
    scale_dtype: DType | None
    payload_bits: int
    #: elements per scale: 16/32 (FP4 groups), GROUP_HEAD_DIM (int8/int4: one row), 0 (no scale pool)
    group_size: int
    scale_bytes_per_group: int
    uses_global_scale: bool
    #: granularity of the scale-pool scales (NONE when there is no scale pool)
    scale_granularity: ScaleGranularity = ScaleGranularity.NONE

    # ------------------------------------------------------------------ geometry
    def check_head_dim(self, head_dim: int) -> None:
        """Raise KvxError(INVALID_ARGUMENT) unless `head_dim` can be stored in this format."""
        if not is_int(head_dim) or head_dim <= 0:
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: head_dim must be a positive int, got {head_dim!r}")
        per_byte = 8 // self.payload_bits if self.payload_bits < 8 else 1
        if head_dim % per_byte:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: head_dim {head_dim} must be a multiple of {per_byte} (packed payload)")
        if self.group_size > 0 and head_dim % self.group_size:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: head_dim {head_dim} must be a multiple of the group size {self.group_size}")

    def group_len(self, head_dim: int) -> int:
        """Elements covered by one scale (head_dim for per-token-head formats, 0 without scale pool)."""
        return head_dim if self.group_size == GROUP_HEAD_DIM else self.group_size

    def groups_per_token_head(self, head_dim: int) -> int:
        """Number of scale-pool groups per (token, KV head)."""
        self.check_head_dim(head_dim)
        g = self.group_len(head_dim)
        return head_dim // g if g > 0 else 0

    def payload_dim(self, head_dim: int) -> int:
        """Last-dim length of the payload tensor, in storage elements."""
        self.check_head_dim(head_dim)
        return head_dim * self.payload_bits // 8 if self.payload_bits < 8 else head_dim

    def scale_dim(self, head_dim: int) -> int:
        """Bytes per (token, KV head) in the scale pool (0 if the format has none)."""
        return self.groups_per_token_head(head_dim) * self.scale_bytes_per_group

    def bytes_per_token_head(self, head_dim: int) -> float:
        """Payload + scale-pool bytes for one (token, KV head) row of `head_dim` values."""
        self.check_head_dim(head_dim)
        return head_dim * self.payload_bits / 8 + self.scale_dim(head_dim)

    def bytes_per_element(self, head_dim: int) -> float:
        """Average stored bytes per KV value (payload + scale pool), e.g. 0.5625 for NVFP4."""
        return self.bytes_per_token_head(head_dim) / head_dim

    @property
    def torch_data_dtype(self) -> torch.dtype:
        """The torch dtype of the payload tensor."""
        return torch_dtype(self.data_dtype)

    # ------------------------------------------------------------------ codec
    @abstractmethod
    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """`x[..., H, D]` -> (payload `[..., H, payload_dim]`, scales `uint8[..., H, scale_dim]`)."""

    @abstractmethod
    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        """Inverse of `encode`: `[..., H, D]` in `out_dtype` (computed in FP32, then cast)."""

    def kernel_facts(self) -> KernelFormat | None:
        """What the kernels need to know of this format, declared here so that `ops.kernel_format` is one lookup
        and a new format the kernels already decode touches no kernel module (None: no kernel reads it)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # ------------------------------------------------------------------ shared validation
    def _check_input(self, x: Tensor) -> Tensor:
        """Validate `x[..., H, D]` and return it as FP32 (`to_f32_saturated`: finite stays finite)."""
        if not isinstance(x, Tensor):
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: encode expects a torch.Tensor, got {type(x)}")
        if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: encode expects a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
        if x.dim() < 2:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: encode expects [..., H, D], got shape {tuple(x.shape)}")
        self.check_head_dim(int(x.shape[-1]))
        return to_f32_saturated(x)

    def _check_stored(self, payload: Tensor, scales: Tensor, out_dtype: torch.dtype) -> int:
        """Validate a stored (payload, scales) pair and the decode's `out_dtype`; return head_dim."""
        if not isinstance(payload, Tensor) or not isinstance(scales, Tensor):
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: decode expects torch tensors")
        check_out_dtype(out_dtype)
        if payload.dtype != self.torch_data_dtype:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: payload dtype must be {self.torch_data_dtype}, got {payload.dtype}")
        if scales.dtype != torch.uint8:
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: scales must be uint8 bytes, got {scales.dtype}")
        if payload.dim() < 2:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: payload must be [..., H, payload_dim], got {tuple(payload.shape)}")
        pdim = int(payload.shape[-1])
        head_dim = pdim * 8 // self.payload_bits if self.payload_bits < 8 else pdim
        if head_dim == 0:
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: empty head_dim")
        self.check_head_dim(head_dim)
        want = tuple(payload.shape[:-1]) + (self.scale_dim(head_dim),)
        if tuple(scales.shape) != want:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: scales shape must be {want} for payload {tuple(payload.shape)}, "
                           f"got {tuple(scales.shape)}")
        return head_dim

    def _global_scale(self, global_scale: Tensor | float | None, num_heads: int, device: torch.device) -> Tensor | None:
        """Validate the FP32 global scale and return it shaped `[H, 1]` or `[1, 1]` (None if not used)."""
        if not self.uses_global_scale:
            if global_scale is not None:
                raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: this format takes no global scale")
            return None
        if global_scale is None:
            return torch.ones((1, 1), dtype=torch.float32, device=device)
        if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
            g = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
        elif isinstance(global_scale, Tensor) and global_scale.is_floating_point() \
                and not global_scale.is_meta:
            g = global_scale.to(device=device, dtype=torch.float32)
        else:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: global_scale must be a float or a float tensor of shape [] or [H] that holds "
                           f"values (not a meta tensor), got {global_scale!r}")
        if g.dim() == 0 or tuple(g.shape) == (1,):
            g = g.reshape(1, 1)
        elif tuple(g.shape) == (num_heads,):
            g = g.reshape(num_heads, 1)
        else:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{self.name}: global_scale shape must be [] or [H={num_heads}], got {tuple(g.shape)}")
        if not bool(torch.all(torch.isfinite(g) & (g > 0))):
            raise KvxError(Status.INVALID_ARGUMENT, f"{self.name}: global_scale must be finite and > 0 in FP32")
        return g


def check_out_dtype(out_dtype: object) -> None:
    """Decoded values are floats (NaN marks a poisoned group): `out_dtype` must be a float torch.dtype."""
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise KvxError(Status.INVALID_ARGUMENT, f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")


def is_int(n: object) -> bool:
    """True for a Python int that is not a bool (a bool is a flag, never a size or a count)."""
    return isinstance(n, int) and not isinstance(n, bool)


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return is_int(n) and n > 0 and (n & (n - 1)) == 0
