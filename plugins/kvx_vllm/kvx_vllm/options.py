"""Run options (`--additional-config '{"kvx": {"rotate": true}}'`) and the startup refusals.

Options under the "kvx" key of vLLM's `additional_config`:
- `rotate` (bool, default false): Hadamard rotation of K/V (and Q) for kvx_nvfp4, kvx_mxfp4,
  kvx_int4 and kvx_k8v4 (not kvx_int8, whose error is already ~0.02% perplexity).
- `prefill` ("split", "split_fused" or "cache", default "split"): how steps with new prompt tokens attend. "split":
  the new tokens over their own unquantized K/V (FlashAttention on CUDA) merged by LSE with KVX over the cached
  prefix (`prefill.SplitPrefill`; as fast as vLLM's BF16 prefill; a prefix-cache hit agrees with a miss within the
  format's error), the prefixes of requests with many new tokens dequantized once per layer and attended dense on
  CUDA (`prefill.DensePrefix`). "split_fused": the same with every prefix on KVX's fused prefill kernel (no dense
  buffer; the route before the dense one, for comparison or as a fallback). "cache": everything over the quantized
  pages with KVX's prefill kernel (bit-identical prefix reuse; 3-5x slower attention in prefill).
- `lm_head` ("mxfp4", default unset): the output projection quantized to MXFP4 after loading (`lm_head`), any
  cache dtype; CPU (torch reference) and NVIDIA Hopper (vLLM's Marlin over the codec's weight); see `lm_head` for
  what it refuses.
- `kv_calibration` (a path, default unset): the KV-cache calibration file to serve with (`calibration`); without
  it, `<model dir>/kvx_kv_calibration.kvxcal` (or the older `.kvx` name) when that exists. `kvx_*` cache dtypes only.
- `transport` ("store" or "nixl"), `nixl_buffer`, `nixl_slots`, `nixl_hold_s`, `nixl_memory` ("host" or
  "device"): how the KV connector hands KV over
  (`connector`).
- `store`, `kvtc` (paths): the KV connector's bundle store and KVTC calibration (`connector`); their older
  `kv_connector_extra_config` spellings `kvx_store` / `kvx_kvtc` are read with a DeprecationWarning.
Each option is a setting of `kvx_core.config` (types, defaults, and the `KVX_<NAME>` environment variable that
stands in when the key is absent: docs/guide/configuration.md). Anything else under "kvx" is refused, so a typo
never silently does nothing; so are other `kvx*` keys in `kv_connector_extra_config`. Also refused: an
`additional_config` that is not a JSON object, and a key that spells "kvx" another way ("KVX",
" kvx"), which would otherwise be ignored. Errors are ValueError (as vLLM's own config checks
raise) naming the option to fix.
This module and `dtypes` import nothing from vLLM at module level (tests load them without vLLM).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvx_core import config
from kvx_core.errors import KvxError

from .dtypes import format_name, is_kvx_dtype
from .parallel import context_parallel

_KNOWN = {s.name for s in config.SETTINGS if s.vllm}
LM_HEAD_FORMATS = config.BY_NAME["lm_head"].choices
CONNECTOR = ("KvxConnector", "kvx_vllm.connector", "KvxConnector")
"""(name for --kv-transfer-config, module, class) of the KVX KV connector."""
PREFILL_ROUTES = config.BY_NAME["prefill"].choices
SPECULATORS = ("ngram", "eagle")
"""Speculative decoding methods verified with KVX pages (`tests/vllm/test_vllm_spec_decode.py`): the target's 1 + k
verification tokens per request run as a multi-row decode (`backend.KvxMetadataBuilder`); EAGLE's draft head has an
attention layer of its own in the target's KV cache group, whose steps vLLM's proposer builds through the same builder
(`build_for_drafting`: a pass over the step's tokens, then one row per request and draft token)."""


@dataclass(frozen=True)
class KvxOptions:
    """The plugin's per-run options."""

    rotate: bool = False
    prefill: str = "split"
    lm_head: str | None = None
    kv_calibration: str | None = None
    store: str | None = None
    kvtc: str | None = None
    store_prefix_block: int | None = None
    store_max_bytes: int | None = None
    transport: str = "store"
    nixl_buffer: int = 1 << 30
    nixl_slots: int = 8
    nixl_hold_s: int = 60
    nixl_memory: str = "host"


def options_of(vllm_config: Any) -> KvxOptions:
    """Parse `vllm_config.additional_config["kvx"]` (ValueError on unknown keys or wrong types)."""
    try:
        given = config.vllm_given(getattr(vllm_config, "additional_config", None), _connector_extra(vllm_config))
        values = {name: config.resolve(name, given) for name in _KNOWN}
    except KvxError as e:
        raise ValueError(f"KVX: {e.message}") from None
    dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    kv_calibration = values["kv_calibration"]
    if kv_calibration.value is not None and dtype is not None and not is_kvx_dtype(dtype):
        # refused here, not at backend selection, which an explicit --attention-backend bypasses: every language
        # model parses these options when it builds its head (the plugin's ParallelLMHead)
        raise ValueError(f"KVX: kv_calibration ({kv_calibration.source}) applies to kvx_* cache dtypes; "
                         f"--kv-cache-dtype {dtype} is vLLM's own cache (its fp8 takes the checkpoint's k_scale / "
                         "v_scale)")
    return KvxOptions(**{name: v.value for name, v in values.items()})


def _connector_extra(vllm_config: Any) -> Mapping:
    """`--kv-transfer-config`'s `kv_connector_extra_config` ({} when absent or not a mapping: vLLM checks it)."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else {}


def refusals(vllm_config: Any) -> list[str]:
    """Every configured vLLM feature a `kvx_*` cache dtype cannot serve, each with the reason."""
    cache, par = vllm_config.cache_config, vllm_config.parallel_config
    out = []
    if cache.kv_cache_dtype_skip_layers:
        out.append("--kv-cache-dtype-skip-layers: every attention layer must use the KVX page layout")
    if vllm_config.kv_transfer_config is not None and not _is_kvx_connector(vllm_config.kv_transfer_config):
        out.append("--kv-transfer-config: vLLM's other connectors copy raw pages and refuse mixed dtypes; "
                   'use {"kv_connector": "KvxConnector", ...} (kvx_vllm.connector)')
    spec = vllm_config.speculative_config
    if spec is not None and getattr(spec, "method", None) not in SPECULATORS:
        out.append(f"speculative decoding with method {getattr(spec, 'method', None)!r}: verified with KVX pages for "
                   f"{', '.join(map(repr, SPECULATORS))} only (EAGLE-3, MTP and draft models run attention layers of "
                   "their own through the backend, with other inputs or query layouts than EAGLE's: not tested)")
    cp = context_parallel(par)
    if cp is not None:
        out.append(f"context parallelism ({cp}): each rank would hold every N-th token of a sequence's KV and vLLM "
                   "would merge the ranks' partial attention by log-sum-exp; the KVX backend serves neither (it "
                   "attends each sequence over its consecutive tokens and hands vLLM no log-sum-exp)")
    model = vllm_config.model_config
    if model is not None and model.use_mla:
        out.append("MLA models: KVX formats are defined for K/V heads, not MLA latents")
    return out


def _is_kvx_connector(kv_transfer_config: Any) -> bool:
    """True when `--kv-transfer-config` names the KVX connector (by name or module path)."""
    return (getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR[0]
            or getattr(kv_transfer_config, "kv_connector_module_path", None) == CONNECTOR[1])


def check_config(vllm_config: Any) -> str:
    """Validate a run with a `kvx_*` cache dtype at startup; returns its KVX format name."""
    reasons = refusals(vllm_config)
    if reasons:
        raise ValueError(f"KVX cache dtype {vllm_config.cache_config.cache_dtype} cannot be used with: "
                         + "; ".join(reasons))
    return format_name(vllm_config.cache_config.cache_dtype, options_of(vllm_config).rotate)
