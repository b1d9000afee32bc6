"""`KvxConnectorScheduler` / `KvxConnectorWorker`: TensorRT-LLM's KV cache connector over KVX bundles.

    LLM(model="/path/to/checkpoint", backend="pytorch",
        kv_connector_config=KvCacheConnectorConfig(connector_module="kvx_trtllm.connector",
                                                   connector_scheduler_class="KvxConnectorScheduler",
                                                   connector_worker_class="KvxConnectorWorker"))
    # the store directory: KVX_STORE=/dev/shm/kvx (KVX_ROLE=both | producer | consumer, default both)
    # FP8 caches: KVX_KV_SCALES=/path/scales.json, the per-layer kv_scale_quant_orig TRT-LLM runs with
    # KVTC-coded entries (~16x smaller, lossy): KVX_KVTC=/path/calibration.safetensors (`kvx kvtc calibrate`)

The scheduler looks every new request's prompt up in a `BundleStore` (bundles keyed by the model fingerprint and
the token ids, the same store the vLLM connector and `kvx` CLI use); on a hit it reports the bundled tokens beyond
what TRT-LLM already holds, in whole blocks and short of the prompt's last token (which the model computes for the
first logits). The worker loads them into the blocks TRT-LLM allocated, converted into the cache's dtype, before
the forward (`start_load_kv`); a producer exports each prompt whose prefill completes in a step after the forward
(`wait_for_save`). Loads and saves are synchronous (`get_num_new_matched_tokens` answers `load_async=False`,
`request_finished` False), so `get_finished` has nothing to report.

A load that fails after the scheduler promised the tokens (the entry vanished or is damaged: every bundle is
checked whole before the first byte is stored, so nothing is written) raises: TRT-LLM has no way to recompute
promised tokens, and the request must not run on blocks that were never loaded.

TRT-LLM facts (tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py, commit 035ab91; older releases:
tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py): both classes are built with `llm_args`; the worker gets
`get_unique_primary_pool()` `[num_blocks, num_layers, kv_factor, H*T*D]` in `register_kv_caches`; block ids are
rows of that pool, shared by every layer; `SchedulerOutput.new_requests` carry the whole prompt and the blocks
allocated so far, with `computed_position` excluding the tokens this connector matched; `cached_requests` carry
the blocks and tokens added since. Served: one rank (no tensor / pipeline parallelism), beam width 1, bf16 / fp16
/ fp32 caches, and FP8 caches when `KVX_KV_SCALES` names a JSON list of one `kv_scale_quant_orig` per layer (x = fp8
* s; a regular file of at most `MAX_KV_SCALES_BYTES`, strict JSON): the connector API passes no scales, so they
come from the operator, and KVX cannot check they are the ones TRT-LLM's attention runs with. FP8 bundles keep the
cache's bytes and its scales (a cache of the same scales takes them bit for bit; any other cache decodes and
re-encodes with its own scales: `kvx_core.transfer.handoff`). Without `KVX_KV_SCALES` FP8 caches are refused:
bytes under a guessed scale would be wrong KV in the importing engine. NVFP4 caches are refused: the worker
receives no block-scale pool.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvx_core import config, jsonsafe
from kvx_core.errors import KvxError
from kvx_core.transfer import BundleStore, ModelFingerprint, fingerprint_from_files
from kvx_core.transfer.kvtc_bundle import calibration_for

from .cache import layer_views

try:  # TRT-LLM's base classes where TRT-LLM is installed (moved to connectors/ in 2025)
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler as _SchedulerBase,
        KvCacheConnectorWorker as _WorkerBase,
    )
except ImportError:
    try:
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
            KvCacheConnectorScheduler as _SchedulerBase,
            KvCacheConnectorWorker as _WorkerBase,
        )
    except ImportError:  # no TRT-LLM: the same classes without its base (what tests and tools use)
        _SchedulerBase = _WorkerBase = object

logger = logging.getLogger("kvx_trtllm.connector")


@dataclass
class Transfer:
    """One request's bundle traffic in a step: its prompt (the store key), the pool slots of the tokens moved
    (block * tokens_per_block + position) and, for a load, which bundled tokens `[start, stop)` they are."""

    request_id: int
    token_ids: list[int]
    slots: list[int]
    token_range: tuple[int, int] | None = None


@dataclass
class KvxConnectorMetadata:
    """What the scheduler tells the workers each step (picklable: TRT-LLM broadcasts it to every rank)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(frozen=True)
class ConnectorConfig:
    """What both sides read from `llm_args` and the environment."""

    store: BundleStore
    model: ModelFingerprint
    tokens_per_block: int
    producer: bool
    consumer: bool
    kv_scales: tuple[float, ...] | None = None  # per-layer kv_scale_quant_orig of an FP8 cache (KVX_KV_SCALES)


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    """`obj.a.b...`, or `default` where a link is missing."""
    for n in names:
        obj = getattr(obj, n, None)
        if obj is None:
            return default
    return obj


def connector_config(llm_args: Any) -> ConnectorConfig:
    """The connector's settings (ValueError naming what to fix when a setting is missing or not served)."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = _get(llm_args, name, default=None) or _get(llm_args, "parallel_config", name, default=1)
        if int(size) != 1:
            raise ValueError(f"KVX connector: {name}={size} is not served (one bundle holds one rank's whole cache)")
    if int(_get(llm_args, "max_beam_width", default=1) or 1) != 1:
        raise ValueError("KVX connector: beam search is not served (TRT-LLM's connectors require beam width 1)")
    model = str(_get(llm_args, "model", default="") or "")
    tok_dir = str(_get(llm_args, "tokenizer", default=None) or model)
    paths = [os.path.join(model, "config.json"), os.path.join(tok_dir, "tokenizer.json")]
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"KVX connector: {p} not found; the bundle fingerprint hashes the model's config.json and "
                             "tokenizer.json (serve a local checkpoint directory)")
    tpb = _get(llm_args, "kv_cache_config", "tokens_per_block", default=None) or \
        _get(llm_args, "tokens_per_block", default=None)
    if not tpb:
        raise ValueError("KVX connector: llm_args.kv_cache_config.tokens_per_block is not set")
    try:
        root, role, kvtc, kv_scales = (config.value(n) for n in ("store", "role", "kvtc", "kv_scales"))
    except KvxError as e:
        raise ValueError(f"KVX connector: {e.message}") from None
    if not root:
        raise ValueError("KVX connector: set KVX_STORE to the bundle store directory, e.g. KVX_STORE=/dev/shm/kvx")
    model_fp = fingerprint_from_files(*paths)
    try:
        import xxhash  # noqa: F401  (bundle checksums: a missing package fails at startup, not per request)
        store = BundleStore(root, kvtc=calibration_for(kvtc, model_fp) if kvtc else None)
    except ImportError:
        raise ValueError("KVX connector: needs the xxhash package (pip install 'kvx[transfer]')") from None
    except KvxError as e:
        raise ValueError(f"KVX connector: {e}") from None
    return ConnectorConfig(store, model_fp, int(tpb), role != "consumer", role != "producer", _kv_scales(kv_scales))


MAX_KV_SCALES_BYTES = 1 << 20
"""A KVX_KV_SCALES file larger than this is refused unread (one scale per layer takes ~20 bytes of JSON)."""


def _positive_finite(v: object) -> float | None:
    """A JSON number as a finite float > 0, None for anything else (bools, strings, ints beyond FP64)."""
    f = jsonsafe.finite_number(v)
    return f if f is not None and f > 0 else None


def _kv_scales(path: str | None) -> tuple[float, ...] | None:
    """The per-layer FP8 `kv_scale_quant_orig` from the JSON list at `path`: a regular file of at most
    `MAX_KV_SCALES_BYTES`, strict JSON (`jsonsafe`); ValueError naming what is wrong."""
    if not path:
        return None
    what = f"KVX connector: KVX_KV_SCALES={path}"
    try:
        if not os.path.isfile(path):
            raise ValueError(f"{what} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_KV_SCALES_BYTES + 1)
        if len(data) > MAX_KV_SCALES_BYTES:
            raise ValueError(f"{what} is larger than {MAX_KV_SCALES_BYTES} bytes (MAX_KV_SCALES_BYTES)")
        values = jsonsafe.loads(data, "the file")
    except OSError as e:
        raise ValueError(f"{what}: cannot read a JSON list of scales ({e})") from None
    except KvxError as e:
        raise ValueError(f"{what}: cannot read a JSON list of scales ({e.message})") from None
    scales = [_positive_finite(v) for v in values] if isinstance(values, list) else []
    if not scales or None in scales:
        raise ValueError(f"{what} must hold a JSON list of finite positive numbers, one kv_scale_quant_orig per layer")
    return tuple(scales)


def _slots(blocks: list[int], start: int, stop: int, tpb: int) -> list[int]:
    """Pool slots of tokens `[start, stop)` (ValueError on a missing or released (-1) block)."""
    if stop > len(blocks) * tpb:
        raise ValueError(f"tokens up to {stop} need {-(-stop // tpb)} blocks, {len(blocks)} are allocated")
    if stop > start and any(b < 0 for b in blocks[start // tpb:-(-stop // tpb)]):
        raise ValueError("a block of the range was released (-1)")
    return [blocks[t // tpb] * tpb + t % tpb for t in range(start, stop)]


class KvxConnectorScheduler(_SchedulerBase):
    """Rank 0's half: decides which requests load bundled tokens and which prompts are saved, each step."""

    def __init__(self, llm_args: Any):
        if _SchedulerBase is not object:
            super().__init__(llm_args)
        self.config = connector_config(llm_args)
        self._prompts: dict[int, list[int]] = {}
        self._blocks: dict[int, list[int]] = {}
        self._matched: dict[int, tuple[int, int]] = {}  # request -> bundled tokens [start, stop) promised

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Bundled prompt tokens beyond the `num_computed_tokens` TRT-LLM holds: whole blocks, the prompt's last
        token left to compute. Loaded synchronously (`load_async` False)."""
        cfg = self.config
        if not cfg.consumer:
            return 0, False
        ids = [int(t) for t in request.get_tokens(0)]
        try:
            header = cfg.store.header(cfg.model, ids)
        except KvxError as e:
            logger.warning("KVX connector: request %s: store entry refused (%s); computing the prompt",
                           request.request_id, e)
            return 0, False
        tpb = cfg.tokens_per_block
        stop = 0 if header is None else min(int(header["tokens"]["count"]), len(ids) - 1) // tpb * tpb
        if stop <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, stop)
        return stop - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self._blocks[request.request_id] = [int(b) for b in block_ids]

    def build_connector_meta(self, scheduler_output: Any) -> KvxConnectorMetadata:
        """This step's loads (requests admitted with bundled tokens) and saves (prompts whose prefill completes)."""
        meta = KvxConnectorMetadata()
        for r in scheduler_output.new_requests:
            rid = r.request_id
            self._prompts[rid] = [int(t) for t in r.new_tokens]
            self._blocks[rid] = [int(b) for b in r.new_block_ids]
            loaded = 0
            if rid in self._matched:
                a, b = self._matched.pop(rid)
                loaded = b - a
                try:
                    slots = self._slots(rid, a, b)
                except ValueError as e:  # TRT-LLM counts the promised tokens as computed: they must be loaded
                    raise RuntimeError(f"KVX connector: request {rid}: cannot load bundled tokens [{a}, {b}): {e}") \
                        from None
                meta.loads.append(Transfer(rid, self._prompts[rid], slots, (a, b)))
            self._plan_save(meta, rid, r.computed_position + loaded + r.num_scheduled_tokens)
        for r in scheduler_output.cached_requests:
            rid = r.request_id
            if rid not in self._prompts:
                continue
            self._blocks[rid].extend(int(b) for b in r.new_block_ids)
            self._plan_save(meta, rid, r.computed_position + r.num_scheduled_tokens)
        return meta

    def _slots(self, rid: int, start: int, stop: int) -> list[int]:
        return _slots(self._blocks[rid], start, stop, self.config.tokens_per_block)

    def _plan_save(self, meta: KvxConnectorMetadata, rid: int, computed_after: int) -> None:
        """Save the prompt in the step that computes its last token (a producer; prompts not yet in the store)."""
        cfg, prompt = self.config, self._prompts[rid]
        if not cfg.producer or computed_after != len(prompt) or (cfg.model, prompt) in cfg.store:
            return
        try:
            meta.saves.append(Transfer(rid, prompt, self._slots(rid, 0, len(prompt))))
        except ValueError as e:
            logger.warning("KVX connector: request %s: prompt not saved: %s", rid, e)

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Forget the request; False: saves complete inside the step that computes the prompt."""
        for d in (self._prompts, self._blocks, self._matched):
            d.pop(request.request_id, None)
        return False


class KvxConnectorWorker(_WorkerBase):
    """Every rank's half: moves the step's bundles between the store and the KV pool."""

    def __init__(self, llm_args: Any):
        if _WorkerBase is not object:
            super().__init__(llm_args)
        self._metadata: KvxConnectorMetadata | None = None
        self.config = connector_config(llm_args)
        self.pool: torch.Tensor | None = None
        self.caches = None

    def bind_connector_meta(self, metadata: KvxConnectorMetadata) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> KvxConnectorMetadata | None:
        return self._metadata

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """The primary pool `[num_blocks, num_layers, kv_factor, H*T*D]` (ValueError for what is not served; FP8
        pools take their scales from `KVX_KV_SCALES`)."""
        m = self.config.model
        t = kv_cache_tensor
        fp8 = t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if fp8 and self.config.kv_scales is None:
            raise ValueError("KVX connector: an FP8 TRT-LLM cache needs its per-layer kv_scale_quant_orig, which the "
                             "connector API does not pass: set KVX_KV_SCALES to a JSON list of them (one per layer, "
                             "the scales TRT-LLM runs with); FP8 bytes under a guessed scale would be wrong KV in the "
                             "importing engine")
        if not fp8 and self.config.kv_scales is not None:
            raise ValueError(f"KVX connector: KVX_KV_SCALES is for FP8 caches; this pool holds {t.dtype}")
        if t.dim() != 4 or t.shape[1] != m.num_layers:
            raise ValueError(f"KVX connector: the pool {tuple(t.shape)} is not [num_blocks, num_layers="
                             f"{m.num_layers}, kv_factor, H*T*D] (one pool for every layer; variable sliding window "
                             "pools are not served)")
        try:
            self.caches = layer_views(t, tokens_per_block=self.config.tokens_per_block,
                                      num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                      kv_scale_quant_orig=self.config.kv_scales)
        except KvxError as e:
            raise ValueError(f"KVX connector: {e}") from None
        self.pool = t

    def _meta(self) -> KvxConnectorMetadata:
        meta = self._metadata
        if not isinstance(meta, KvxConnectorMetadata) or self.caches is None:
            raise RuntimeError("KVX connector: no step metadata bound, or register_kv_caches was not called")
        return meta

    def start_load_kv(self, stream: Any) -> None:
        """Load this step's bundled tokens into their blocks on `stream`, before the forward (synchronously)."""
        meta, cfg = self._meta(), self.config
        with torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext():
            for t in meta.loads:
                try:
                    found = cfg.store.get(self.caches, torch.tensor(t.slots, dtype=torch.int64), model=cfg.model,
                                          token_ids=t.token_ids, token_range=t.token_range)
                except KvxError as e:
                    raise RuntimeError(f"KVX connector: request {t.request_id}: loading {len(t.slots)} bundled tokens "
                                       f"failed, nothing written: {e}") from e
                if not found:
                    raise RuntimeError(f"KVX connector: request {t.request_id}: its bundle left the store between "
                                       "scheduling and loading; nothing was written")

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        return  # the prompt is exported in wait_for_save, once every layer has written it

    def wait_for_save(self, stream: Any) -> None:
        """Export each prompt completed in this step (atomically; a failure is logged, a consumer then computes the
        prompt itself)."""
        meta, cfg = self._meta(), self.config
        if stream is not None:
            stream.synchronize()  # the forward that wrote the prompt's KV ran on this stream
        for t in meta.saves:
            try:
                cfg.store.put(self.caches, torch.tensor(t.slots, dtype=torch.int64), model=cfg.model,
                              token_ids=t.token_ids)
            except (KvxError, OSError) as e:
                logger.error("KVX connector: request %s: saving its %d prompt tokens failed: %s", t.request_id,
                             len(t.slots), e)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        return [], []  # nothing asynchronous: saves and loads finish inside their step

