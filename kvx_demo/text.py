"""The demo's evaluation text and its tokenization into fixed-length windows.

Default text: the English Python documentation topics bundled with every CPython install
(`pydoc_data.topics.topics`, a dict topic-name -> text). The text is the topic strings joined in
sorted key order with a blank line ("\\n\\n") between them. It is deterministic for a given
CPython minor version but differs between versions (3.11.7 here: 79 topics, 465,126 characters),
so `text_fingerprint` is printed with results to make them comparable.

Windows are consecutive, non-overlapping slices of the token stream, taken from its start:
window i is tokens [i*L, (i+1)*L). No BOS/special tokens are added (SmolLM2's tokenizer adds
none by default either).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvx_core.errors import KvxError, Status, int_value, require

TEXT_NAME = "pydoc_data.topics"


def default_text() -> str:
    """All `pydoc_data.topics` topic strings, sorted by key, joined by a blank line."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_fingerprint(text: str) -> str:
    """Short sha256 of the text (first 12 hex digits), to tell which text a result came from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def tokenize(tokenizer: Any, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of `text` as a 1-D int64 tensor, without special tokens.

    With `max_tokens`, only a prefix of the text long enough for that many tokens is encoded
    (re-encoding a longer prefix until it suffices), which keeps the demo fast: the whole default
    text is ~110k tokens. The ids of a prefix equal the leading ids of the full encoding, except
    possibly the last one or two, which are cut off with a margin.
    """
    require(isinstance(text, str), Status.INVALID_ARGUMENT, f"text must be a str, got {type(text).__name__}")
    if max_tokens is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    max_tokens = _count(max_tokens, "max_tokens", 1)
    chars = max(4096, max_tokens * 6)
    while True:
        piece = text[:chars]
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        # A prefix cut mid-word can tokenize its tail differently: keep a margin of 16 tokens.
        if chars >= len(text):
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
        if len(ids) >= max_tokens + 16:
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
        chars *= 2


def _count(value: object, what: str, lo: int) -> int:
    """`value` as an int >= `lo` (Python or NumPy/torch integer scalar; not a bool or float), else
    INVALID_ARGUMENT: a float count would otherwise fail deep inside torch, or be truncated."""
    n = int_value(value)
    require(n is not None and n >= lo, Status.INVALID_ARGUMENT, f"{what} must be an int >= {lo}, got {value!r}")
    return n


def is_integer_tensor(t: torch.Tensor) -> bool:
    """Token ids must be integers: a float or bool tensor would be cast to ids silently."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def make_windows(ids: torch.Tensor, num_windows: int, window_len: int) -> torch.Tensor:
    """`[num_windows, window_len]` int64: consecutive non-overlapping windows from the start of `ids`."""
    num_windows = _count(num_windows, "num_windows", 1)
    window_len = _count(window_len, "window_len", 2)
    require(isinstance(ids, torch.Tensor) and ids.dim() == 1 and is_integer_tensor(ids), Status.INVALID_ARGUMENT,
            f"ids must be a 1-D integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)} "
            f"of shape {tuple(getattr(ids, 'shape', ()))}")
    need = num_windows * window_len
    if ids.numel() < need:
        raise KvxError(
            Status.OUT_OF_RANGE,
            f"{num_windows} windows of {window_len} tokens need {need} tokens; the text has {ids.numel()}",
        )
    return ids[:need].reshape(num_windows, window_len).clone()


def load_windows(
    tokenizer: Any, num_windows: int, window_len: int, text: str | None = None
) -> torch.Tensor:
    """Tokenize `text` (default: `default_text()`) and cut it into windows (see `make_windows`)."""
    if text is None:
        text = default_text()
    ids = tokenize(tokenizer, text, max_tokens=num_windows * window_len)
    return make_windows(ids, num_windows, window_len)
