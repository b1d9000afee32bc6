"""Typed strided views of a byte buffer's storage, each dtype viewed once: a bundle's tensors of every layer with
a fixed number of tensor ops per bundle and one per tensor (the host cost of export / import per layer, issue 36)."""
from __future__ import annotations

import torch


class StorageViews:
    """Strided views of the storage under a contiguous 1-D uint8 `buf`, by byte offset into `buf`: the storage is
    viewed once per dtype, then each tensor is one `as_strided` (a bundle's tensors of every layer, with a fixed
    number of tensor ops per bundle and one per tensor)."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.base, self.storage = buf, buf.storage_offset(), buf.untyped_storage()
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def view(self, pos: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The contiguous `shape` tensor of `dtype` at byte `pos` of `buf`; None where `pos` is not aligned to the
        dtype's width."""
        views = self.views([pos], dtype, shape)
        return views[0] if views else None

    def views(self, positions: list[int], dtype: torch.dtype, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """`view` at each byte position of `positions` (a bundle's layers: the strides worked out once, then one
        `as_strided` each); [] where any is not aligned to the dtype's width."""
        size = dtype.itemsize
        if any((self.base + pos) % size for pos in positions):
            return []
        if dtype not in self.typed:
            self.typed[dtype] = torch.empty(0, dtype=dtype, device=self.buf.device).set_(
                self.storage, 0, (self.storage.nbytes() // size,), (1,))
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        strides.reverse()
        typed, base = self.typed[dtype], self.base
        return [typed.as_strided(shape, strides, (base + pos) // size) for pos in positions]
