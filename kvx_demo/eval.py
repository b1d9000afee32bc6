"""Perplexity and top-1 next-token predictions of the demo model, with a pluggable KV cache.

What is measured. Each window of L tokens is run from an empty cache, prefilled in chunks of
`chunk_size` tokens (default 128). For every chunk, each attention layer hands its new K/V
(post-RoPE) to `cache.update`, and attends over what `update` returns. With a cache whose
`update` stores the new K/V and returns the stored-then-reloaded K/V of ALL tokens so far (the new
ones included: see `hf_cache.py`), every query attends only to K/V that went through the cache
format. Queries, activations and weights stay float32; only K/V storage differs between formats.

Chunking does not change what a correct cache measures (a single full-window prefill through such
a cache sees the same stored K/V), but it makes the model read earlier tokens back from the cache
across calls, as decode does, so a cache that, e.g., only quantizes on a later call, or loses
tokens between calls, shows up. Chunk boundaries do not change the maths: with an exact cache the
logits match a one-shot forward up to float rounding.

Over a window, positions 0..L-2 predict tokens 1..L-1: L-1 scored tokens per window. Perplexity
is exp(total NLL / total scored tokens) over all windows (token-weighted).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvx_core.errors import KvxError, Status, int_value, require

from .text import is_integer_tensor

CacheFactory = Callable[[], Any]  # returns a transformers Cache (fresh, empty) for one window


@dataclass
class EvalResult:
    """Per-window results of `evaluate`."""

    nll_sums: list[float]  # summed negative log-likelihood (nats) of each window's scored tokens
    token_counts: list[int]  # scored tokens per window (window_len - 1)
    predictions: torch.Tensor  # [num_windows, window_len - 1] int64: argmax next token at each position
    targets: torch.Tensor  # [num_windows, window_len - 1] int64: the actual next tokens
    seconds: float  # wall time of the forward passes (cache creation included)
    tokens_processed: int  # tokens run through the model (num_windows * window_len)
    window_seconds: list[float] = field(default_factory=list)

    @property
    def total_nll(self) -> float:
        return float(sum(self.nll_sums))

    @property
    def total_tokens(self) -> int:
        return int(sum(self.token_counts))

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.total_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def window_perplexities(self) -> list[float]:
        return [math.exp(n / c) for n, c in zip(self.nll_sums, self.token_counts, strict=True)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_processed / self.seconds if self.seconds > 0 else float("inf")

    @property
    def top1_accuracy(self) -> float:
        """Fraction of positions whose argmax prediction is the actual next token."""
        return float((self.predictions == self.targets).float().mean())

    def top1_agreement(self, reference: EvalResult) -> float:
        """Fraction of positions where this run's argmax equals `reference`'s (e.g. the BF16 run)."""
        if self.predictions.shape != reference.predictions.shape:
            raise KvxError(
                Status.INVALID_ARGUMENT,
                f"cannot compare predictions of shape {tuple(self.predictions.shape)} "
                f"with {tuple(reference.predictions.shape)}",
            )
        return float((self.predictions == reference.predictions).float().mean())


def _default_cache_factory(model: Any) -> CacheFactory:
    from transformers import DynamicCache

    return lambda: DynamicCache(config=model.config)


def evaluate(
    model: Any,
    windows: torch.Tensor,
    cache_factory: CacheFactory | None = None,
    *,
    chunk_size: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Score `windows` ([N, L] int64 token ids) with the model, one window at a time (batch 1).

    `cache_factory()` is called once per window and must return an empty transformers `Cache`,
    passed as `past_key_values`; None means `DynamicCache(config=model.config)` (float32, exact).
    `chunk_size` tokens are fed per forward call (<= 0 or >= L: the whole window at once).
    `progress(done, total)` is called after each window.
    """
    require(isinstance(windows, torch.Tensor) and is_integer_tensor(windows) and windows.dim() == 2
            and windows.shape[0] >= 1 and windows.shape[1] >= 2, Status.INVALID_ARGUMENT,
            f"windows must be an integer tensor [N>=1, L>=2], got {getattr(windows, 'dtype', type(windows).__name__)} "
            f"{tuple(getattr(windows, 'shape', ()))}")
    chunk = int_value(chunk_size)
    require(chunk is not None, Status.INVALID_ARGUMENT, f"chunk_size must be an int, got {chunk_size!r}")
    num_windows, window_len = windows.shape
    chunk_size = window_len if chunk <= 0 or chunk > window_len else chunk
    factory = cache_factory or _default_cache_factory(model)
    device = next(model.parameters()).device
    windows = windows.to(device=device, dtype=torch.long)

    nll_sums: list[float] = []
    counts: list[int] = []
    window_seconds: list[float] = []
    preds = torch.empty(num_windows, window_len - 1, dtype=torch.long)
    targets = windows[:, 1:].cpu().clone()

    with torch.inference_mode():
        for w in range(num_windows):
            start = time.perf_counter()
            ids = windows[w : w + 1]
            cache = factory()
            nll = torch.zeros((), dtype=torch.float64)
            for s in range(0, window_len, chunk_size):
                e = min(s + chunk_size, window_len)
                out = model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True)
                # Logits at positions s..e-1 predict tokens s+1..e; the window's last position has no target.
                logits = out.logits[0, : min(e, window_len - 1) - s].float()
                if logits.shape[0] == 0:
                    continue
                tgt = ids[0, s + 1 : s + 1 + logits.shape[0]]
                logp = torch.log_softmax(logits, dim=-1)
                nll += -logp.gather(1, tgt.unsqueeze(1)).sum().double().cpu()
                preds[w, s : s + logits.shape[0]] = logits.argmax(dim=-1).cpu()
                if cache.get_seq_length() != e:
                    raise KvxError(
                        Status.INTERNAL_ERROR,
                        f"cache holds {cache.get_seq_length()} tokens after feeding {e}: "
                        "its get_seq_length() must count every token passed to update()",
                    )
            del cache
            window_seconds.append(time.perf_counter() - start)
            nll_sums.append(float(nll))
            counts.append(window_len - 1)
            if progress is not None:
                progress(w + 1, num_windows)

    return EvalResult(
        nll_sums=nll_sums,
        token_counts=counts,
        predictions=preds,
        targets=targets,
        seconds=float(sum(window_seconds)),
        tokens_processed=num_windows * window_len,
        window_seconds=window_seconds,
    )
