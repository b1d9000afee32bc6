"""Triton kernels for KVX paged caches, one module per kernel with its launcher (torch tensors in, torch
tensors out):

- `write.py`   `write_pools`: fused quantize + scatter of new K/V tokens by slot mapping
- `gather.py`  `gather_pools`: dequantize through the block table into dense ragged K/V (`launch_gather`: the
               kernel alone, for `ops.bound_gather`)
- `decode.py`  the split-KV decode kernel and `launch_decode` (checks, backend and split choice, and the
               raw-pool entry `decode_pools`: `kvx_core/ops/decode.py`)
- `merge.py`   the split merge of the decode kernels (Triton and CUDA)
- `prefill.py` `prefill_pools`: causal prefill/extend attention over the quantized pools, and its plan
- `rows.py`    `plan_layer_rows`: a KV bundle's chunk rows gathered from / scattered into every pool of its layers
- `convert.py` `plan_convert` / `decode_rows`: bundled rows decoded and re-encoded into another format's pools
- `launch.py`  argument checks and kernel arguments shared by the launchers; `dequant.py` / `quant.py` the
               `@triton.jit` format decoders / encoders
Pools follow the storage contract: data `[num_blocks, H_kv, block_size, Dk]` (HND, any strides,
last dim contiguous), scales `uint8 [num_blocks, H_kv, block_size, Sk]`, global scales fp32 `[H_kv]`,
block table int32 `[B, max_blocks]`, seq_lens int32 `[B]`, slot mapping int64 `[T]` (< 0 = skip).
On CPU the kernels run under `TRITON_INTERPRET=1` (set before triton is imported).
"""
from __future__ import annotations

from .gather import gather_pools
from .launch import interpreting
from .prefill import PrefillPlan, plan_prefill, prefill_pools
from .write import write_pools

__all__ = ["PrefillPlan", "plan_prefill", "prefill_pools", "write_pools", "gather_pools", "interpreting"]
