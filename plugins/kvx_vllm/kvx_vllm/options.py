"""Run options (`--additional-config '{"kvx": {"rotate": true}}'`) and the startup refusals.

Options under the "kvx" key of vLLM's `additional_config`:
- `rotate` (bool, default false): Hadamard rotation of K/V (and Q) for kvx_nvfp4, kvx_mxfp4,
  kvx_int4 and kvx_k8v4 (not kvx_int8, whose error is already ~0.02% perplexity).
Anything else under "kvx" is refused, so a typo never silently does nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import format_name

_KNOWN = {"rotate"}


@dataclass(frozen=True)
class KvxOptions:
    """The plugin's per-run options."""

    rotate: bool = False


def options_of(vllm_config: Any) -> KvxOptions:
    """Parse `vllm_config.additional_config["kvx"]` (ValueError on unknown keys or wrong types)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("kvx", {})
    if not isinstance(raw, dict):
        raise ValueError(f'KVX: --additional-config "kvx" must be an object such as {{"rotate": true}}, got {raw!r}')
    unknown = set(raw) - _KNOWN
    if unknown:
        raise ValueError(f"KVX: unknown --additional-config kvx option(s) {sorted(unknown)}; known: {sorted(_KNOWN)}")
    rotate = raw.get("rotate", False)
    if not isinstance(rotate, bool):
        raise ValueError(f'KVX: --additional-config kvx "rotate" must be true or false, got {rotate!r}')
    return KvxOptions(rotate=rotate)


def refusals(vllm_config: Any) -> list[str]:
    """Every configured vLLM feature a `kvx_*` cache dtype cannot serve, each with the reason."""
    cache, par = vllm_config.cache_config, vllm_config.parallel_config
    out = []
    if cache.kv_cache_dtype_skip_layers:
        out.append("--kv-cache-dtype-skip-layers: every attention layer must use the KVX page layout")
    if vllm_config.kv_transfer_config is not None:
        out.append("--kv-transfer-config: vLLM connectors copy raw pages and refuse mixed dtypes; "
                   "KVX's own connector is not part of this plugin yet")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding: not verified with KVX pages")
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        out.append("context parallelism (DCP/PCP): the KVX kernels do not merge partial attention across ranks")
    model = vllm_config.model_config
    if model is not None and model.use_mla:
        out.append("MLA models: KVX formats are defined for K/V heads, not MLA latents")
    return out


def check_config(vllm_config: Any) -> str:
    """Validate a run with a `kvx_*` cache dtype at startup; returns its KVX format name."""
    reasons = refusals(vllm_config)
    if reasons:
        raise ValueError(f"KVX cache dtype {vllm_config.cache_config.cache_dtype} cannot be used with: "
                         + "; ".join(reasons))
    return format_name(vllm_config.cache_config.cache_dtype, options_of(vllm_config).rotate)
