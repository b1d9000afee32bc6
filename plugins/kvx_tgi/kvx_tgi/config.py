"""The run's KVX settings for TGI (format, block size, cache memory cap) and what the backend refuses.

TGI reads `ATTENTION` and `PREFIX_CACHING` from the environment when `models.globals` is imported (the
Rust launcher sets them); the backend serves:
- `ATTENTION=paged` (BLOCK_SIZE 16): whole-prompt prefill, no prefix caching (TGI's rule for `paged`);
- `ATTENTION=flashdecoding` (BLOCK_SIZE 256): chunked prefill and prefix caching, the attention reading
  cached tokens back from the KVX pools;
and refuses `flashinfer` (TGI's BLOCK_SIZE 1 there: a page per token, a scale group per token for every
4-bit format) and `flashdecoding-ipex` (Intel devices, not verified), as well as speculative decoding (checked
when the cache is built) and sliding windows (checked where TGI passes them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvx_core import config as kvx_config
from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import CacheFormat, get_format, list_formats

SERVED_ATTENTION = ("paged", "flashdecoding")
CACHE_MEMORY_ENV = kvx_config.BY_NAME["kv_cache_memory"].env
FORMAT_ENV = kvx_config.BY_NAME["format"].env


def format_names() -> list[str]:
    """KVX formats the TGI backend accepts: every KVX cache format except fp32 (TGI models run in 16 bits)."""
    return [n for n in list_formats() if n != "fp32"]


def parse_bytes(text: str, what: str = CACHE_MEMORY_ENV) -> int:
    """`123`, `64MiB`, `2GiB`, `512k` -> bytes (binary units); INVALID_ARGUMENT otherwise."""
    return kvx_config.parse_bytes(text, what)


@dataclass(frozen=True)
class RunConfig:
    """What `install` fixed for this process."""

    format: CacheFormat
    attention: str
    block_size: int  # TGI's BLOCK_SIZE for `attention`
    cache_memory: int | None  # bytes the KV cache may take (None: TGI's free-memory rule)

    def check_cache_dtype(self, dtype: torch.dtype) -> None:
        """At cache construction (after TGI parsed its flags): TGI's `--kv-cache-dtype` (FP8) cannot be combined
        with a KVX format (the KVX format is the cache), nor `--speculate`."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise KvxError(Status.UNSUPPORTED,
                           f"--kv-cache-dtype {dtype} with the KVX backend: drop it and pick the cache format with "
                           f"{FORMAT_ENV} (fp8_e4m3 / fp8_e5m2 are KVX formats too)")
        from text_generation_server.utils.speculate import get_speculate

        if get_speculate():
            raise KvxError(Status.UNSUPPORTED, f"--speculate {get_speculate()} with the KVX backend: speculative "
                                               "decoding is not supported (not verified); drop --speculate")


_current: RunConfig | None = None


def resolve(format: str | None) -> RunConfig:
    """The run's settings from `format` (else `$KVX_FORMAT`) and TGI's environment; refusals as KvxError."""
    name = format if format is not None else kvx_config.value("format")
    require(bool(name), Status.INVALID_ARGUMENT,
            f"no KVX format: pass install(format=...) or set {FORMAT_ENV} to one of {', '.join(format_names())}")
    require(name in format_names(), Status.INVALID_ARGUMENT,
            f"{FORMAT_ENV}={name!r} is not a KVX format the TGI backend serves; use one of {', '.join(format_names())}")
    attention = os.environ.get("ATTENTION")
    require(attention is not None, Status.INVALID_ARGUMENT,
            "ATTENTION is not set: TGI's launcher sets it; set ATTENTION=paged (whole-prompt prefill) or "
            "ATTENTION=flashdecoding (chunked prefill, prefix caching)")
    require(attention in SERVED_ATTENTION, Status.UNSUPPORTED,
            f"ATTENTION={attention}: the KVX backend serves {' and '.join(SERVED_ATTENTION)}"
            + (" (flashinfer's BLOCK_SIZE is 1: a page and a scale group per token)" if attention == "flashinfer"
               else ""))
    require("PREFIX_CACHING" in os.environ, Status.INVALID_ARGUMENT,
            "PREFIX_CACHING is not set: TGI's launcher sets it; set PREFIX_CACHING=0, or 1 with "
            "ATTENTION=flashdecoding")
    block_size = {"paged": 16, "flashdecoding": 256}[attention]
    return RunConfig(get_format(name), attention, block_size, kvx_config.value("kv_cache_memory"))


def set_current(run: RunConfig) -> None:
    global _current
    _current = run


def current() -> RunConfig:
    """The installed run's settings (KvxError before `kvx_tgi.install`)."""
    require(_current is not None, Status.INVALID_ARGUMENT,
            "the KVX TGI backend is not installed: call kvx_tgi.install(format=...) before importing TGI's models")
    return _current
