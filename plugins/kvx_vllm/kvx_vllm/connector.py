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

NIXL transport (`transport: "nixl"`, `kvx_core.transfer.nixl`; across hosts, no store): a producer publishes the
prompt of each request whose `kv_transfer_params` has `"do_remote_decode": true` (vLLM's P/D proxies set it) into a
slot of its worker's NIXL buffer at the end of the step that completes the prompt, and `request_finished` returns
`{"kvx_ticket": ...}` as the request's `kv_transfer_params`; the proxy passes them to the consumer's request. The
ticket is a lookup ticket (the scheduler mints it before the worker exports, from the worker's agent and slot
directory, which the worker hands the scheduler at startup: vLLM's handshake metadata). The consumer's scheduler
parses it strictly (a bad ticket is a logged miss) and loads all but the prompt's last token; its worker READs the
bundle and imports it with every check, all or nothing; a failure (refused ticket, bundle gone, its slot reused,
damaged) is a failed load as above. A slot is held until the consumer's READ completes (every consumer rank's that
reads it) or `nixl_hold_s` passes; with every one of `nixl_slots` held the prompt is not published (logged) and its
consumer fails the load. A tensor-parallel producer's ticket is a ticket set (`nixl.parse_ticket_set`): one lookup
ticket per distinct KV-head range, each published by the first rank holding that range from its own worker's buffer
(the scheduler has every rank's handshake); each consumer rank READs the shards holding its own KV heads, side by
side in its buffer, and imports them through the bundle resharding (any producer and consumer TP sizes vLLM allows).
`nixl_memory: device` puts both workers' NIXL buffers in the GPU memory of their caches (UCX then moves bundles GPU
to GPU), default `host` (pinned host memory); refused at startup without CUDA.

Tensor parallelism: each worker rank exports and imports the KV heads vLLM gives it (`kvx_core.transfer.tp`: split
when the model has at least as many KV heads as ranks, replicated otherwise). A TP=M producer's entry is a shard set
(`BundleStore.write_shard`: one bundle per distinct head range, written by the first rank holding it, and a manifest
published by whichever rank completes the set), so the scheduler (one process) sees an entry only once every shard
is there; a TP=N consumer rank (N may differ from M) imports its heads from the shards through the bundle resharding.
Every rank reads every shard of the set, so one missing or damaged shard fails the load on every rank alike, with
nothing written on any (vLLM unions the ranks' failed blocks). Pipeline and context parallelism are refused at startup
(`parallel`); data-parallel ranks are engines of their own, each with its connector (untested).
"""
from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvx_core.errors import KvxError, Status
from kvx_core.transfer import BundleStore
from kvx_core.transfer.kvtc_bundle import calibration_for
from kvx_core.transfer.nixl import NixlPeer, parse_ticket_set
from kvx_core.transfer.tp import ranks_reading, tp_head_range, writes_shard

from .fingerprint import model_fingerprint
from .layer_kv import LayerCaches
from .options import options_of
from .parallel import context_parallel, tp_rank

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
    ticket: dict | str | None = None  # a load over NIXL: the consumer request's ticket
    seq: int | None = None  # a save over NIXL: the seq its ticket looks the bundle up by


@dataclass
class KvxConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class KvxNixlHandshake(KVConnectorHandshakeMetadata):
    """A producer worker's NIXL agent and slot directory: a lookup ticket but its seq (worker -> scheduler at
    startup)."""

    ticket: dict


class KvxConnector(KVConnectorBase_V1):
    """Moves prompts' KV between vLLM instances (and to / from a store) as KVX bundles."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("KVX connector: pipeline parallelism is not served yet (a bundle holds every layer); run "
                             "with --pipeline-parallel-size 1")
        cp = context_parallel(par)
        if cp is not None:
            raise ValueError(f"KVX connector: context parallelism ({cp}) is not served: each rank's cache would hold "
                             "every N-th token of a request, and the connector saves and loads a request's "
                             "consecutive tokens block by block; run with context-parallel sizes 1")
        try:
            import xxhash  # noqa: F401  (bundle checksums; a missing package must fail at startup, not per request)
        except ImportError:
            raise ValueError("KVX connector: needs the xxhash package (pip install kvx-vllm pulls kvx[transfer])") \
                from None
        from .compat import check_failure_policy, check_vllm_version

        check_failure_policy(getattr(cfg, "kv_load_failure_policy", "fail"), check_vllm_version())
        opts = options_of(vllm_config)
        self.nixl = opts if opts.transport == "nixl" else None
        if self.nixl is not None:
            self._check_nixl(opts)
        elif not opts.store:
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
            self.store = None if self.nixl else BundleStore(
                opts.store, kvtc=calibration_for(kvtc, self.model) if kvtc else None,
                prefix_block=opts.store_prefix_block, max_bytes=opts.store_max_bytes)
        except KvxError as e:
            raise ValueError(f"KVX connector: {e}") from None
        self.producer, self.consumer = cfg.is_kv_producer, cfg.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        self.cache_dtype = vllm_config.cache_config.cache_dtype
        # scheduler side
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._loads: dict[str, tuple[int, int, list[int], dict | str | None]] = {}
        self._publish: set[str] = set()  # NIXL: requests whose prompts are to be published
        self._tickets: dict[str, dict] = {}  # NIXL: the tickets of the prompts published for these requests
        self._directories: dict[int, dict] = {}  # NIXL: each worker rank's lookup ticket but its seq (handshake)
        self._seq = 0
        # worker side
        self._sender: NixlPeer | None = None
        self._receiver: NixlPeer | None = None
        self._caches: LayerCaches | None = None
        self.tp_rank = 0
        self.kv_heads = (0, self.model.num_kv_heads)
        self._failed: set[int] = set()

    @staticmethod
    def _check_nixl(opts: Any) -> None:
        """The NIXL transport's startup refusals (ValueError, as vLLM's config checks raise)."""
        if opts.store or opts.kvtc:
            raise ValueError('KVX connector: transport "nixl" takes no store (nor kvtc, a store coding); unset '
                             'them, or use transport "store"')
        try:
            import nixl._api  # noqa: F401
        except ImportError:
            raise ValueError('KVX connector: transport "nixl" needs NIXL: pip install --no-deps nixl==1.5.1 '
                             "nixl-cu12==1.5.1") from None
        if opts.nixl_memory == "device" and not torch.cuda.is_available():
            raise ValueError('KVX connector: nixl_memory "device" puts the NIXL buffers in GPU memory, and this '
                             'platform has no CUDA device; use nixl_memory "host"')

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of the longest stored prefix of the prompt (NIXL: of the ticketed prompt) beyond the
        `num_computed_tokens` held locally, up to the prompt's last token."""
        if self.nixl is not None:
            return self._match_ticket(request, num_computed_tokens)
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
        self._loads[request.request_id] = (num_computed_tokens, stop, entry, None)
        return stop - num_computed_tokens, False

    def _match_ticket(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """NIXL: a producer notes the requests to publish; a consumer loads the prompt of a request carrying a
        ticket (checked here: a bad one is a logged miss) but its last token."""
        rid, params = request.request_id, getattr(request, "kv_transfer_params", None)
        params = params if isinstance(params, dict) else {}
        if self.producer and params.get("do_remote_decode") is True:
            self._publish.add(rid)
        ticket = params.get("kvx_ticket")
        if not self.consumer or ticket is None:
            return 0, False
        try:
            parse_ticket_set(ticket)
        except KvxError as e:
            logger.warning("KVX connector: request %s: its kvx_ticket is refused (%s); computing the prompt", rid, e)
            return 0, False
        ids = list(request.prompt_token_ids or [])
        stop = len(ids) - 1
        if stop <= num_computed_tokens:
            return 0, False
        self._loads[rid] = (num_computed_tokens, stop, ids, ticket)
        return stop - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens == 0:
            self._loads.pop(rid, None)
        elif rid in self._loads:
            start, _, entry, ticket = self._loads[rid]
            self._loads[rid] = (start, start + num_external_tokens, entry, ticket)
            if ticket is not None:  # loaded once: a preempted request recomputes rather than reads a stale slot
                request.kv_transfer_params.pop("kvx_ticket", None)

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
            a, b, entry, ticket = self._loads.pop(rid)
            meta.loads.append(Transfer(rid, entry, self._slots(rid, a, b), (a, b), ticket=ticket))
        if not (self.producer and computed < len(prompt) <= computed + scheduled):
            return
        if self.nixl is None:
            if (self.model, prompt) not in self.store:
                meta.saves.append(Transfer(rid, prompt, self._slots(rid, 0, len(prompt))))
        elif rid in self._publish:
            ticket = self._ticket(self._seq + 1)
            if ticket is None:
                missing = [r for r in self._publishers() if r not in self._directories]
                logger.error("KVX connector: request %s: the NIXL handshakes of worker ranks %s did not reach the "
                             "scheduler; its prompt is not published", rid, missing)
                return
            self._seq += 1
            self._tickets[rid] = ticket
            meta.saves.append(Transfer(rid, prompt, self._slots(rid, 0, len(prompt)), seq=self._seq))

    def _publishers(self) -> list[int]:
        """The worker ranks that publish a prompt: the first rank of each distinct KV-head range."""
        return [r for r in range(self.tp_size) if writes_shard(self.model.num_kv_heads, self.tp_size, r)]

    def _ticket(self, seq: int) -> dict | None:
        """The ticket of the prompt the workers publish under `seq`: one rank's lookup ticket when one range holds
        every KV head, else a ticket set of one lookup ticket per range; None while a publisher's handshake is
        missing."""
        ranks = self._publishers()
        if any(r not in self._directories for r in ranks):
            return None
        if len(ranks) == 1:
            return {**self._directories[ranks[0]], "seq": seq}
        heads = self.model.num_kv_heads
        return {"shards": [{**self._directories[r], "seq": seq, "kv_heads": list(tp_head_range(heads, self.tp_size, r))}
                           for r in ranks]}

    def _slots(self, rid: str, start: int, stop: int) -> list[int]:
        blocks, b = self._blocks[rid], self.block_size
        return [blocks[t // b] * b + t % b for t in range(start, stop)]

    def _forget(self, rid: str) -> None:
        for d in (self._blocks, self._prompts, self._loads, self._tickets):
            d.pop(rid, None)
        self._publish.discard(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves complete inside the step that computes the prompt (its blocks may go); a published prompt's ticket
        becomes the request's `kv_transfer_params` (`{"kvx_ticket": ...}`)."""
        ticket = self._tickets.pop(request.request_id, None)
        self._forget(request.request_id)
        return False, None if ticket is None else {"kvx_ticket": ticket}

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """NIXL: each producer worker rank's agent and slot directory (keyed by TP rank), from which the scheduler
        mints tickets."""
        self._directories = {r: h.ticket for r, h in metadata.items() if isinstance(h, KvxNixlHandshake)}

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This worker's caches, and its tensor-parallel rank and KV-head range."""
        self.tp_rank = tp_rank(self._vllm_config)
        self.kv_heads = tp_head_range(self.model.num_kv_heads, self.tp_size, self.tp_rank)
        layers = self._vllm_config.compilation_config.static_forward_context
        self._caches = LayerCaches(kv_caches, layers, self.cache_dtype)
        if self.nixl is not None:
            name = f"kvx-{uuid.uuid4().hex}"
            memory = self.nixl.nixl_memory  # device: the GPU holding this worker's caches
            where = {"memory": memory, "device": next(iter(kv_caches.values())).device.index
                     if memory == "device" else None}
            try:
                if self.producer:
                    self._sender = NixlPeer(name + "-send", self.nixl.nixl_buffer, slots=self.nixl.nixl_slots,
                                            hold_s=self.nixl.nixl_hold_s, **where)
                if self.consumer:
                    self._receiver = NixlPeer(name + "-recv", self.nixl.nixl_buffer, **where)
            except KvxError as e:
                raise ValueError(f"KVX connector: {e}") from None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """NIXL producer: this worker's agent and slot directory, for the scheduler's tickets."""
        if self._sender is None:
            return None
        return KvxNixlHandshake({k: v for k, v in self._sender.lookup_ticket(0).items() if k != "seq"})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's bundled tokens (this rank's KV heads, from every shard of the entry) into the cache
        before the forward runs (synchronously)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata) and self._caches is not None
        for t in meta.loads:
            try:  # opening is reading outside bytes too (a KVTC entry decodes, an entry may be forged or unreadable)
                if t.ticket is not None:  # NIXL: READ, then import with every check
                    self._caches.load(self._fetch(t.ticket), torch.tensor(t.slots, dtype=torch.int64),
                                      model=self.model, token_ids=t.token_ids, token_range=t.token_range,
                                      kv_heads=self.kv_heads)
                    continue
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

    def _fetch(self, ticket: dict | str) -> list[torch.Tensor]:
        """NIXL: READ the shards of a ticket holding any of this rank's KV heads, side by side (256-byte aligned) in
        this worker's buffer; each READ tells its sender how many consumer ranks read that shard."""
        heads, out, at = self.model.num_kv_heads, [], 0
        a, b = self.kv_heads
        for t, held in parse_ticket_set(ticket):
            held = held or (0, heads)
            if held[0] < b and a < held[1]:
                out.append(self._receiver.fetch(t, at=at, readers=ranks_reading(held, heads, self.tp_size)))
                at += -(-out[-1].numel() // 256) * 256
        if not out:
            raise KvxError(Status.INVALID_ARGUMENT, f"the ticket's shards hold none of this rank's KV heads [{a}, {b})")
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the whole prompt is exported in wait_for_save, once every layer has written it

    def wait_for_save(self) -> None:
        """Export each prompt completed in this step into the store: this rank's KV heads as its shard (atomically;
        a failure is logged, the set then stays incomplete and the consumer computes the prompt itself); NIXL:
        publish it under its ticket's seq (a failure, e.g. every slot held, is logged: its consumer's load fails)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata) and self._caches is not None
        for t in meta.saves:
            slots = torch.tensor(t.slots, dtype=torch.int64)
            try:
                if t.seq is not None:
                    if not writes_shard(self.model.num_kv_heads, self.tp_size, self.tp_rank):
                        continue  # an earlier rank publishes these KV heads
                    caches, at = self._caches.export_source(slots)
                    self._sender.publish(caches, at, model=self.model, token_ids=t.token_ids,
                                         kv_heads=self.kv_heads, seq=t.seq)
                    continue
                self.store.write_shard(self.model, t.token_ids, self.tp_size, self.tp_rank,
                                       lambda f, slots=slots, ids=t.token_ids: self._caches.export(
                                           f, slots, model=self.model, token_ids=ids, kv_heads=self.kv_heads))
            except Exception as e:  # noqa: BLE001 - a failed save must not fail the request
                logger.error("KVX connector: request %s: saving its %d prompt tokens failed: %s", t.req_id,
                             len(t.slots), e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed
