"""Which code moves a bundle's rows, and the Triton side of it: the one selection point of export and import.

`use_kernels(device)` is True for caches on CUDA (Triton available): export gathers each layer's chunk with one
kernel (`ops.triton.rows`), import scatters each layer with one kernel after every check passed, and conversions
decode the source rows and encode them through the fused write's encoders (`ops.triton.convert`). Elsewhere
(CPU caches) the torch code of `rows` / `handoff` serves. Both give the same bytes (tests run the kernels on the
CPU under TRITON_INTERPRET=1). `kernel_path("torch" | "triton")` overrides the choice in a `with` block: the
benchmark compares both paths in one run, the tests force the kernels on the CPU.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import Status, require

PATHS = ("torch", "triton")
_forced: str | None = None


def use_kernels(device: torch.device | str) -> bool:
    """Whether bundle rows on `device` move through the Triton kernels (CUDA, unless `kernel_path` says else)."""
    if _forced is not None:
        return _forced == "triton"
    from ..ops import dispatch

    return dispatch._kernel_device(torch.device(device))


@contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Serve exports and imports inside the block by `path` ("torch": the reference code on any device,
    "triton": the kernels, on CUDA or under the Triton interpreter)."""
    global _forced
    require(path in PATHS, Status.INVALID_ARGUMENT, f"kernel_path must be one of {PATHS}, got {path!r}")
    before, _forced = _forced, path
    try:
        yield
    finally:
        _forced = before
