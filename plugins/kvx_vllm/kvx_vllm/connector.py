"""`KvxConnector`: vLLM's KV connector (`KVConnectorBase_V1`) over KVX bundles, for prefill/decode disaggregation
between instances that differ in cache dtype and block size, and for offload / reload of prompts' KV.

    --kv-transfer-config '{"kv_connector": "KvxConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}'
    --additional-config '{"kvx": {"store": "/dev/shm/kvx"}}'     # or KVX_STORE=/dev/shm/kvx
    # KVTC-coded entries (~16x smaller, lossy): add "kvtc": "/path/calibration.safetensors" (`kvx kvtc calibrate`)
    # (the older kv_connector_extra_config {"kvx_store": ..., "kvx_kvtc": ...} is still read, deprecated)
    # prefix reuse granularity and a size cap: "store_prefix_block": 16, "store_max_bytes": "8GiB"

A producer writes the KV of each prompt it computes into a `BundleStore` directory (one bundle per prompt, keyed by
the model fingerprint and the token ids) at the end of the step that completes the prompt. A consumer looks every
new request's prompt up in the store (`BundleStore.longest_prefix`: the entry of the whole prompt, else the stored
entry sharing the longest prefix with it, in blocks of the store's prefix block, `store_prefix_block`); on a hit
it loads that entry's tokens of the shared prefix that it does not already hold locally (up to the prompt's last
token, which vLLM always computes for the first logits), converted into its own cache: any
`kvx_*` dtype, `auto` or `fp8`, any block size (`layer_kv`). Loads are synchronous, before the step's forward, and
all-or-nothing per request: a bundle that fails a check (damaged, another model or tokenizer) writes nothing, is
logged with its reason, and its blocks are reported to vLLM as failed loads (`kv_load_failure_policy`: "fail" by
default, "recompute" to recompute them). The store directory is the transport: a path both instances reach (the
same host; `/dev/shm` for memory speed, a disk path to keep KV across restarts). `kvx_store_max_bytes` caps it
(least recently used entries evicted; an entry evicted between the scheduler's lookup and the load is a failed load
like a damaged one).

Tensor parallelism: each worker rank exports and imports the KV heads vLLM gives it (`kvx_core.transfer.tp`: split
when the model has at least as many KV heads as ranks, replicated otherwise). A TP=M producer's entry is a shard set
(`BundleStore.write_shard`: one bundle per distinct head range, written by the first rank holding it, and a manifest
published by whichever rank completes the set), so the scheduler (one process) sees an entry only once every shard
is there; a TP=N consumer rank (N may differ from M) imports its heads from the shards through the bundle resharding.
Every rank reads every shard of the set, so one missing or damaged shard fails the load on every rank alike, with
nothing written on any (vLLM unions the ranks' failed blocks). Pipeline parallelism is refused at startup.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from kvx_core.errors import KvxError
from kvx_core.transfer import BundleStore
from kvx_core.transfer.kvtc_bundle import calibration_for
from kvx_core.transfer.tp import tp_head_range

from .fingerprint import model_fingerprint
from .layer_kv import LayerCaches
from .options import options_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.plugins.kvx.connector")


@dataclass
class Transfer:
    """One request's bundle traffic in a step: the token ids of the store entry (a save: the prompt; a load: the
    entry whose prefix the prompt shares), the vLLM slots of the tokens moved and, for a load, which bundled tokens
    `[start, stop)` they are."""

    req_id: str
    token_ids: list[int]
    slots: list[int]
    token_range: tuple[int, int] | None = None


@dataclass
class KvxConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class KvxConnector(KVConnectorBase_V1):
    """Moves prompts' KV between vLLM instances (and to / from a store) as KVX bundles."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("KVX connector: pipeline parallelism is not served yet (a bundle holds every layer); run "
                             "with --pipeline-parallel-size 1")
        try:
            import xxhash  # noqa: F401  (bundle checksums; a missing package must fail at startup, not per request)
        except ImportError:
            raise ValueError("KVX connector: needs the xxhash package (pip install kvx-vllm pulls kvx[transfer])") \
                from None
        from .compat import vllm_version

        if vllm_version() == (0, 26) and getattr(cfg, "kv_load_failure_policy", "fail") == "recompute":
            raise ValueError('KVX connector: kv_load_failure_policy "recompute" is refused on vLLM 0.26: after a '
                             "refused (damaged) bundle its scheduler decoded from the unloaded blocks instead of "
                             'recomputing them (H100 run); use "fail" (the default), or vLLM 0.32')
        opts = options_of(vllm_config)
        if not opts.store:
            raise ValueError('KVX connector: set the store directory, e.g. --additional-config \'{"kvx": {"store": '
                             '"/dev/shm/kvx"}}\' or KVX_STORE=/dev/shm/kvx')
        self.model = model_fingerprint(vllm_config)
        self.tp_size = par.tensor_parallel_size
        try:
            tp_head_range(self.model.num_kv_heads, self.tp_size, 0)
        except KvxError as e:
            raise ValueError(f"KVX connector: {e}") from None
        kvtc = opts.kvtc  # a `kvx kvtc calibrate` file: KVTC-coded entries
        try:
            self.store = BundleStore(opts.store, kvtc=calibration_for(kvtc, self.model) if kvtc else None,
                                     prefix_block=opts.store_prefix_block, max_bytes=opts.store_max_bytes)
        except KvxError as e:
            raise ValueError(f"KVX connector: {e}") from None
        self.producer, self.consumer = cfg.is_kv_producer, cfg.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        self.cache_dtype = vllm_config.cache_config.cache_dtype
        # scheduler side
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._loads: dict[str, tuple[int, int, list[int]]] = {}
        # worker side
        self._caches: LayerCaches | None = None
        self.tp_rank = 0
        self.kv_heads = (0, self.model.num_kv_heads)
        self._failed: set[int] = set()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of the longest stored prefix of the prompt beyond the `num_computed_tokens` held locally, up to
        the prompt's last token."""
        params = getattr(request, "sampling_params", None)
        if not self.consumer or getattr(params, "skip_reading_prefix_cache", None):  # 0.26 asks us, 0.32 does not
            return 0, False
        ids = list(request.prompt_token_ids or [])
        try:
            matched, entry = self.store.longest_prefix(self.model, ids)
        except KvxError as e:
            logger.warning("KVX connector: request %s: store entry refused (%s); computing the prompt",
                           request.request_id, e)
            return 0, False
        stop = min(matched, len(ids) - 1)
        if entry is None or stop <= num_computed_tokens:
            return 0, False
        self._loads[request.request_id] = (num_computed_tokens, stop, entry)
        return stop - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens == 0:
            self._loads.pop(rid, None)
        elif rid in self._loads:
            start, _, entry = self._loads[rid]
            self._loads[rid] = (start, start + num_external_tokens, entry)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (requests admitted with bundled tokens) and saves (prompts completed in this step)."""
        so = scheduler_output
        meta = KvxConnectorMetadata()
        for r in so.scheduled_new_reqs:
            self._blocks[r.req_id] = list(r.block_ids[0])
            self._prompts[r.req_id] = list(r.prompt_token_ids or [])
            self._plan(meta, r.req_id, r.num_computed_tokens, so.num_scheduled_tokens.get(r.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new[0]) if new else []
            elif new is not None:
                self._blocks.setdefault(rid, []).extend(new[0])
            self._plan(meta, rid, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0))
        for rid in so.finished_req_ids:
            self._forget(rid)
        return meta

    def _plan(self, meta: KvxConnectorMetadata, rid: str, computed: int, scheduled: int) -> None:
        prompt = self._prompts.get(rid)
        if prompt is None:
            return
        if rid in self._loads:
            a, b, entry = self._loads.pop(rid)
            meta.loads.append(Transfer(rid, entry, self._slots(rid, a, b), (a, b)))
        if (self.producer and computed < len(prompt) <= computed + scheduled
                and (self.model, prompt) not in self.store):
            meta.saves.append(Transfer(rid, prompt, self._slots(rid, 0, len(prompt))))

    def _slots(self, rid: str, start: int, stop: int) -> list[int]:
        blocks, b = self._blocks[rid], self.block_size
        return [blocks[t // b] * b + t % b for t in range(start, stop)]

    def _forget(self, rid: str) -> None:
        for d in (self._blocks, self._prompts, self._loads):
            d.pop(rid, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves complete inside the step that computes the prompt

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This worker's caches, and its tensor-parallel rank and KV-head range."""
        if self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
            self.kv_heads = tp_head_range(self.model.num_kv_heads, self.tp_size, self.tp_rank)
        layers = self._vllm_config.compilation_config.static_forward_context
        self._caches = LayerCaches(kv_caches, layers, self.cache_dtype)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's bundled tokens (this rank's KV heads, from every shard of the entry) into the cache
        before the forward runs (synchronously)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata) and self._caches is not None
        for t in meta.loads:
            try:  # opening is reading outside bytes too (a KVTC entry decodes, an entry may be forged or unreadable)
                shards = self.store.open_shards(self.model, t.token_ids)
                if shards is None:
                    raise FileNotFoundError("its store entry is gone")
                with contextlib.ExitStack() as opened:
                    for f in shards:
                        opened.enter_context(f)
                    self._caches.load(shards, torch.tensor(t.slots, dtype=torch.int64), model=self.model,
                                      token_ids=t.token_ids, token_range=t.token_range, kv_heads=self.kv_heads)
            except Exception as e:  # noqa: BLE001 - any failure is a failed load vLLM must handle
                logger.error("KVX connector: request %s: loading %d bundled tokens failed, nothing written: %s",
                             t.req_id, len(t.slots), e)
                self._failed.update({s // self.block_size for s in t.slots})

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the whole prompt is exported in wait_for_save, once every layer has written it

    def wait_for_save(self) -> None:
        """Export each prompt completed in this step into the store: this rank's KV heads as its shard (atomically;
        a failure is logged, the set then stays incomplete and the consumer computes the prompt itself)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata) and self._caches is not None
        for t in meta.saves:
            slots = torch.tensor(t.slots, dtype=torch.int64)
            try:
                self.store.write_shard(self.model, t.token_ids, self.tp_size, self.tp_rank,
                                       lambda f, slots=slots, ids=t.token_ids: self._caches.export(
                                           f, slots, model=self.model, token_ids=ids, kv_heads=self.kv_heads))
            except Exception as e:  # noqa: BLE001 - a failed save must not fail the request
                logger.error("KVX connector: request %s: saving its %d prompt tokens failed: %s", t.req_id,
                             len(t.slots), e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed
