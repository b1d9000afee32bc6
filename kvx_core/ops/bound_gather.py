"""The bound gather: a bound layer's pages (`dispatch.bind`) dequantized into dense ragged K / V in one kernel launch
with no host sync, so that a prefill can read a cached prefix once and attend over it with a dense 16-bit kernel
(issue 35's separate pass: `benchmarks/bench_prefill.py --dequant-pass`). The checked gather: `dispatch.gather_kv`."""
from __future__ import annotations

import torch

from ..errors import Status, require
from .checks import IO_DTYPES, check_no_alias
from .dispatch import BoundLayer
from .kernel_format import kernel_format
from .triton.gather import INDEX_DTYPES, launch_gather


@torch.no_grad()
def gather_bound(layer: BoundLayer, block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_len: int, out: tuple[torch.Tensor, torch.Tensor], *, block_t: int = 32) -> None:
    """Dequantize the first `min(seq_lens[b], max_len)` tokens of each sequence of a bound layer (`dispatch.bind`)
    into rows `cu_seqlens[b] ..` of `out = (K, V)`: one kernel launch, no host sync, so that a prefill step can
    dequantize a layer's cached prefix once and hand it to a dense 16-bit attention kernel (issue 35's separate
    pass: FlashInfer's ragged prefill over the gathered K / V).

    What the layer binding checked (pools, scale pools, global scales) is not checked again, and nothing reads device
    values: `block_table` (int32 `[B, max_blocks]`, the kernel table of the layer's table format, whose ids the caller
    vouches for, like an engine's attention metadata), `seq_lens` and `cu_seqlens` (int32 / int64 `[B]` and `[B + 1]`,
    the output row where each sequence starts) are compared by shape, dtype and device only; `max_len` (a host int)
    must be at least every length the caller wants whole. `out` must not overlap itself or the layer's pools (by
    address range: INVALID_ARGUMENT, nothing written). Rotated (`*_rot`) and key-transformed (smoothed / centered)
    layers are refused: their values need a second pass (`gather_kv` serves them)."""
    h, bs, d = layer.geometry
    require(not layer.fmt.rotate and not layer.transforms_keys, Status.UNSUPPORTED,
            f"gather_bound: {layer.fmt.name} layer{' with key smoothing / centering' if layer.transforms_keys else ''} "
            "needs a second pass after the gather (rotation back / key transform): use gather_kv")
    dev = layer.k_data.device
    b = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else -1
    ok = (b >= 0 and block_table.dtype == torch.int32 and block_table.stride(1) == 1
          and isinstance(seq_lens, torch.Tensor) and seq_lens.shape == (b,) and seq_lens.dtype in INDEX_DTYPES
          and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.shape == (b + 1,) and cu_seqlens.dtype in INDEX_DTYPES
          and all(t.device == dev for t in (block_table, seq_lens, cu_seqlens)) and seq_lens.is_contiguous()
          and cu_seqlens.is_contiguous())
    require(ok, Status.INVALID_ARGUMENT,
            f"gather_bound: block_table must be int32 [B, max_blocks] with unit-stride rows, seq_lens int32/int64 [B] "
            f"and cu_seqlens int32/int64 [B + 1], all on {dev}; got {_desc(block_table)}, {_desc(seq_lens)}, "
            f"{_desc(cu_seqlens)}")
    require(type(max_len) is int and max_len >= 0, Status.INVALID_ARGUMENT,
            f"gather_bound: max_len must be a host int >= 0, got {max_len!r}")
    ok = (isinstance(out, (tuple, list)) and len(out) == 2
          and all(isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[1:]) == (h, d) and t.stride(2) == 1
                  and t.dtype in IO_DTYPES and t.device == dev for t in out))
    require(ok, Status.INVALID_ARGUMENT,
            f"gather_bound: out must be two bf16/fp16/fp32 [tokens, {h}, {d}] tensors on {dev} with a unit-stride "
            f"last dim, got {[_desc(t) for t in out] if isinstance(out, (tuple, list)) else type(out).__name__}")
    check_no_alias({"out K": out[0], "out V": out[1]},  # host addresses only: a write into the cache is refused
                   {"K data": layer.k_data, "K scales": layer.k_scales, "V data": layer.v_data,
                    "V scales": layer.v_scales})
    if b and max_len:
        k_side = (layer.k_data, layer.k_scale_args, layer.k_global, out[0], kernel_format(layer.fmt.k))
        v_side = (layer.v_data, layer.v_scale_args, layer.v_global, out[1], kernel_format(layer.fmt.v))
        launch_gather(block_table, seq_lens, cu_seqlens, max_len, k_side, v_side, d, bs, block_t)


def _desc(t) -> str:
    """A tensor's dtype, shape and device for a message (or the type of what is not a tensor)."""
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
