"""A minimal custom transformers `Cache` (transformers 5.x), the template for a KVX-backed one.

How transformers 5.23 uses a cache (LlamaModel / LlamaAttention):

1. `LlamaModel.forward` calls `cache.get_seq_length()` (= tokens already cached) to build the
   position ids, then `create_causal_mask`, which calls `cache.get_query_offset(layer_idx)` and
   `cache.get_mask_sizes(query_length, layer_idx)`, BEFORE any layer updates the cache.
2. Every `LlamaAttention.forward` computes this step's K/V for its layer, applies RoPE, and calls
   `key, value = cache.update(key_states, value_states, self.layer_idx)` (no cache_kwargs in 5.x).
   `key_states`/`value_states` are `[batch, num_kv_heads, new_tokens, head_dim]`, float32 for this
   model, keys already rotated (post-RoPE). What `update` RETURNS is exactly what attention reads:
   `[batch, num_kv_heads, past + new_tokens, head_dim]` (GQA head repetition happens later, in the
   attention function). So if `update` returns the stored-then-reloaded (e.g. de-quantized) K/V
   of ALL tokens, including the ones it was just given, the cache format affects every attention
   score, even in a single full-sequence prefill.
3. `Cache.update` dispatches to `self.layers[layer_idx].update(...)`; `Cache.get_seq_length`,
   `get_mask_sizes`, `get_query_offset`, `is_sliding`, `reset`, ... all go through `self.layers`.
   So the clean way to customise storage is one `CacheLayerMixin` subclass per layer, and a
   `Cache` built with `layers=[...]`.

`RoundTripCache` stores every K/V chunk after passing it through a user "round trip" (e.g. a
quantize -> de-quantize function), and `update` returns the concatenation of all stored chunks.
With no round trip it is exact and matches `DynamicCache` bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

RoundTrip = Callable[[torch.Tensor], torch.Tensor]


def bf16_roundtrip(t: torch.Tensor) -> torch.Tensor:
    """Store-as-BF16 round trip (round to nearest even), back in the input dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


class RoundTripLayer(CacheLayerMixin):
    """One layer's cache: stored K/V chunks in plain Python lists."""

    is_sliding = False  # full attention; `Cache.is_sliding` reads this
    is_compileable = False
    is_croppable = False

    def __init__(self, key_roundtrip: RoundTrip | None = None, value_roundtrip: RoundTrip | None = None):
        super().__init__()  # sets self.keys = self.values = None, self.is_initialized = False
        self.key_roundtrip = key_roundtrip
        self.value_roundtrip = value_roundtrip
        self._key_chunks: list[torch.Tensor] = []
        self._value_chunks: list[torch.Tensor] = []
        self.num_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = self.key_roundtrip(key_states) if self.key_roundtrip else key_states
        v = self.value_roundtrip(value_states) if self.value_roundtrip else value_states
        self._key_chunks.append(k)
        self._value_chunks.append(v)
        self.num_tokens += key_states.shape[-2]
        # Read everything back, the new tokens included.
        if len(self._key_chunks) == 1:
            return self._key_chunks[0], self._value_chunks[0]
        return torch.cat(self._key_chunks, dim=-2), torch.cat(self._value_chunks, dim=-2)

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # (kv_length, kv_offset): attention will see past + new tokens, starting at position 0.
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1  # no maximum

    def reset(self) -> None:
        # The base `reset` zeroes self.keys, which this layer does not use.
        self._key_chunks.clear()
        self._value_chunks.clear()
        self.num_tokens = 0
        self.is_initialized = False

    # The base offload/prefetch move self.keys/self.values, which stay None here (Cache(offloading=True) only).
    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._key_chunks = [c.index_select(0, beam_idx.to(c.device)) for c in self._key_chunks]
        self._value_chunks = [c.index_select(0, beam_idx.to(c.device)) for c in self._value_chunks]


class RoundTripCache(Cache):
    """`Cache` of `RoundTripLayer`s, one per decoder layer.

    >>> cache = RoundTripCache(model.config.num_hidden_layers, bf16_roundtrip, bf16_roundtrip)
    >>> model(input_ids, past_key_values=cache, use_cache=True)
    """

    def __init__(
        self,
        num_layers: int,
        key_roundtrip: RoundTrip | None = None,
        value_roundtrip: RoundTrip | None = None,
    ):
        super().__init__(layers=[RoundTripLayer(key_roundtrip, value_roundtrip) for _ in range(num_layers)])
