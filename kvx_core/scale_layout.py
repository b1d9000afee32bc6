"""V scale pools interleaved by 4 tokens (`KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4`): TRT-LLM's NVFP4 KV layout.

TRT-LLM writes NVFP4 V block scales so that its trtllm-gen attention kernels load 4 tokens' scales of one group
together: in each (block, head) plane of `block_size x S` bytes (S = head_dim / 16), the scale of token `t`, group
`j` sits at `(t // 4) * 4 * S + j * 4 + t % 4` (planes `[block_size / 4, S, 4]`), where a linear pool has `t * S +
j`. The bytes of a block are the same set, permuted inside each plane, so the pool keeps its HND descriptor
`[num_blocks, num_kv_heads, block_size, S]` and the flag says how to read it. No strided view expresses the
permutation (the token index splits across two strides), so readers index it through `Interleave4Rows`.
"""
from __future__ import annotations

import torch

from .descriptors import TensorDesc
from .enums import Layout
from .errors import Status, require

GROUP = 4
"""Tokens whose scales of one group are stored together."""


def check_interleave4(desc: TensorDesc, block_size: int) -> None:
    """An interleaved V scale pool must be HND with contiguous `[block_size, S]` planes and `block_size % 4 == 0`
    (TRT-LLM's blocks are powers of two of at least 8 tokens on its trtllm-gen path); KvxError otherwise."""
    require(block_size % GROUP == 0, Status.UNSUPPORTED,
            f"V scales interleaved by {GROUP} tokens need block_size % {GROUP} == 0, got block_size {block_size}")
    require(desc.layout == Layout.HND and len(desc.shape) == 4, Status.INVALID_ARGUMENT,
            f"V scales interleaved by {GROUP} tokens must be described HND [num_blocks, num_kv_heads, block_size, S], "
            f"got layout {desc.layout.name} shape {desc.shape}")
    s = desc.shape[3]
    require(tuple(desc.stride[2:]) == (s, 1), Status.INVALID_ARGUMENT,
            f"V scales interleaved by {GROUP} tokens need each (block, head) plane of block_size x S bytes to be "
            f"contiguous (strides [..., {s}, 1]), got strides {desc.stride}")


class Interleave4Rows:
    """The token rows of an interleaved V scale pool, indexed like the 5-D block view of a linear one:
    `rows[block, offset]` is `[n, H, S, 1]` (a copy), `rows[block, offset] = x` stores `[n, H, S, 1]` rows."""

    def __init__(self, pool: torch.Tensor):
        """`pool`: the `[N, H, T, S]` HND bytes (uint8) that `check_interleave4` accepted."""
        n, h, t, s = pool.shape
        self.pool = pool
        self._planes = pool.as_strided((n, h, t // GROUP, s, GROUP),
                                       (pool.stride(0), pool.stride(1), GROUP * s, GROUP, 1))
        self.shape = (n, t, h, s, 1)

    def __getitem__(self, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        blk, off = where
        return self._planes[blk, :, off // GROUP, :, off % GROUP].unsqueeze(-1)

    def __setitem__(self, where: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> None:
        blk, off = where
        self._planes[blk, :, off // GROUP, :, off % GROUP] = rows.reshape(-1, *self.shape[2:4])
