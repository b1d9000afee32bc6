"""`KvxConnector`'s NIXL transport (`transport: "nixl"`) without an engine: its scheduler and worker methods (the
real ones, on a connector whose state is set up as `__init__` / `register_kv_caches` set it, over a KVX paged cache
standing in for vLLM's) with real NIXL peers over UCX TCP loopback. A producer publishes a prompt marked
`do_remote_decode` and returns its ticket from `request_finished`; a consumer given that ticket in its request's
`kv_transfer_params` loads all but the last prompt token bit for bit (oracle: the producer's cache rows). Forged,
stale and recycled tickets, and a producer with every slot held: a logged miss or a failed load, nothing written."""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import vllm  # noqa: F401  (missing vLLM is an error: scripts/setup_vllm_env.sh installs it)

try:
    import nixl  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # scripts/setup_vllm_env.sh installs it: missing in CI is a failure, not a skip
        raise
    pytest.skip("NIXL not installed: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1", allow_module_level=True)

from kvx_core.errors import KvxError  # noqa: E402
from kvx_core.transfer import import_bundle  # noqa: E402
from kvx_core.transfer.nixl import NixlPeer  # noqa: E402
from kvx_core.transfer.rows import read_rows  # noqa: E402
from kvx_core.transfer.tp import tp_head_range  # noqa: E402
from kvx_vllm.connector import KvxConnector  # noqa: E402
from tests.fuzz import DEEP  # noqa: E402
from tests.transfer.caches import MODEL, _cache, _descs, _snapshot, _unchanged  # noqa: E402
from tests.transfer.test_nixl import UCX, _rows_equal, _same_scales, _wait_released  # noqa: E402
from tests.vllm.test_vllm_connector_tp import _config  # noqa: E402

pytestmark = [pytest.mark.vllm]

PROMPT = list(range(100, 140))  # 40 tokens: the producer's 16-token blocks, the consumer's 8-token ones
OTHER = list(range(300, 340))  # as many tokens, as many digits: a bundle of the same size
PRODUCER_BS, CONSUMER_BS = 16, 8
CONSUMER_BLOCKS = [7, 5, 3, 1, 0]


@pytest.fixture(autouse=True)
def _ucx_loopback(monkeypatch):
    for k, v in UCX.items():
        monkeypatch.setenv(k, v)


class _Caches:
    """`LayerCaches`' export / load over a KVX paged cache."""

    def __init__(self, cache):
        self.cache = cache

    def export_source(self, slots):
        return _descs(self.cache), slots

    def load(self, src, slots, **kw):
        import_bundle(src, _descs(self.cache), slots, **kw)


def _connector(cache, block_size: int, *, producer: bool, consumer: bool, slots: int = 2,
               hold_s: int = 3600, model=MODEL, tp: tuple[int, int] = (1, 0)) -> KvxConnector:
    """A connector of transport nixl in the state its `__init__` and `register_kv_caches` leave: rank `tp[1]` of
    `tp[0]` (TP=1 by default; a TP=1 producer's scheduler has its worker's handshake)."""
    c = KvxConnector.__new__(KvxConnector)
    c.nixl = SimpleNamespace(nixl_buffer=1 << 20, nixl_slots=slots, nixl_hold_s=hold_s, nixl_memory="host")
    c.store, c.model, c.block_size = None, model, block_size
    c.tp_size, c.tp_rank = tp
    c.kv_heads = tp_head_range(model.num_kv_heads, *tp)
    c.producer, c.consumer = producer, consumer
    c._blocks, c._prompts, c._loads, c._publish, c._tickets, c._directories, c._seq = {}, {}, {}, set(), {}, {}, 0
    c._failed, c._caches, c._connector_metadata = set(), _Caches(cache), None
    name = f"kvx-test-{uuid.uuid4().hex}"
    c._sender = NixlPeer(name + "-send", 1 << 20, slots=slots, hold_s=hold_s) if producer else None
    c._receiver = NixlPeer(name + "-recv", 1 << 20) if consumer else None
    if producer and tp[0] == 1:  # vLLM's startup handshake: the worker's metadata to the scheduler
        c.set_xfer_handshake_metadata({0: c.get_handshake_metadata()})
    return c


def _step(c: KvxConnector, rid: str, prompt: list[int], blocks: list[int], computed: int = 0):
    """One scheduler step admitting `rid` with `computed` tokens already there (loaded), scheduling the rest."""
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(blocks),), prompt_token_ids=prompt,
                                            num_computed_tokens=computed)],
        num_scheduled_tokens={rid: len(prompt) - computed},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                              num_computed_tokens=[]),
        finished_req_ids=set())
    meta = c.build_connector_meta(so)
    c.bind_connector_metadata(meta)
    return meta


def _produce(p: KvxConnector, rid: str, prompt: list[int], slots: torch.Tensor) -> dict | None:
    """A request marked do_remote_decode computed by the producer; its returned kv_transfer_params."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params={"do_remote_decode": True},
                          sampling_params=None)
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    _step(p, rid, prompt, (slots[::PRODUCER_BS] // PRODUCER_BS).tolist())
    p.wait_for_save()
    p.clear_connector_metadata()
    delay, params = p.request_finished(req, [])
    assert delay is False
    return params


def _consume(c: KvxConnector, rid: str, prompt: list[int], params: dict) -> tuple[int, set[int], SimpleNamespace]:
    """A request carrying `params` admitted by the consumer: (tokens matched, failed blocks, the request)."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=dict(params),
                          sampling_params=None)
    n, load_async = c.get_num_new_matched_tokens(req, 0)
    assert load_async is False
    if n:
        c.update_state_after_alloc(req, None, n)
    _step(c, rid, prompt, CONSUMER_BLOCKS, computed=n)
    c.start_load_kv(None)
    c.clear_connector_metadata()
    return n, c.get_block_ids_with_load_errors(), req


def _consumer_slots(n: int) -> torch.Tensor:
    t = torch.arange(n)
    return torch.tensor(CONSUMER_BLOCKS)[t // CONSUMER_BS] * CONSUMER_BS + t % CONSUMER_BS


def _pair(fmt: str = "int8", *, slots: int = 2, hold_s: int = 3600):
    src, src_slots = _cache(fmt, PRODUCER_BS, 4, tokens=len(PROMPT))
    dst = _same_scales(_cache(fmt, CONSUMER_BS, 8)[0], src)
    p = _connector(src, PRODUCER_BS, producer=True, consumer=False, slots=slots, hold_s=hold_s)
    c = _connector(dst, CONSUMER_BS, producer=False, consumer=True)
    return src, src_slots, dst, p, c


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_a_published_prompt_is_loaded_by_the_consumer_bit_for_bit(fmt):
    """The producer's ticket travels as JSON in kv_transfer_params; the consumer loads the prompt but its last token
    into its own block size, bit for bit, its READ releases the producer's slot, and the ticket is taken off the
    request (a preempted request recomputes rather than reading the slot again)."""
    src, src_slots, dst, p, c = _pair(fmt)
    params = _produce(p, "r1", PROMPT, src_slots)
    assert set(params) == {"kvx_ticket"} and json.loads(json.dumps(params)) == params
    assert p._sender.held_slots() == 1 and not p._tickets and not p._publish
    n, failed, req = _consume(c, "r1", PROMPT, json.loads(json.dumps(params)))
    assert (n, failed) == (len(PROMPT) - 1, set()) and "kvx_ticket" not in req.kv_transfer_params
    assert _rows_equal(src, src_slots[:n], dst, _consumer_slots(n))
    _wait_released(p._sender, 0)


def test_requests_not_marked_for_remote_decode_are_not_published():
    src, src_slots, _, p, _ = _pair()
    req = SimpleNamespace(request_id="r1", prompt_token_ids=PROMPT, kv_transfer_params=None, sampling_params=None)
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not _step(p, "r1", PROMPT, (src_slots[::PRODUCER_BS] // PRODUCER_BS).tolist()).saves
    assert p.request_finished(req, []) == (False, None) and p._sender.held_slots() == 0


@pytest.mark.parametrize("ticket", [{"agent": "a", "seq": 1}, "{\"agent\": NaN}", DEEP, "[1]", 7,
                                    {"agent": "a", "seq": 1.5, "directory": 0, "slots": 1, "metadata": "AA=="}])
def test_a_malformed_ticket_is_a_logged_miss(caplog, ticket):
    """The scheduler parses the ticket strictly: a malformed one loads nothing (the prompt is computed)."""
    _, _, dst, _, c = _pair()
    before = _snapshot(dst)
    with caplog.at_level(logging.WARNING):
        n, failed, _ = _consume(c, "r1", PROMPT, {"kvx_ticket": ticket})
    assert (n, failed) == (0, set()) and "kvx_ticket is refused" in caplog.text
    assert _unchanged(dst, before) and not c._loads


def _refused(c, dst, params, prompt, caplog, reason: str) -> None:
    before = _snapshot(dst)
    with caplog.at_level(logging.WARNING):
        n, failed, _ = _consume(c, "r2", prompt, params)
    assert n == len(prompt) - 1 and failed == set(CONSUMER_BLOCKS), (n, failed)  # every loaded block: failed
    assert "loading 39 bundled tokens failed" in caplog.text and reason in caplog.text, caplog.text
    assert _unchanged(dst, before)


def test_stale_and_foreign_tickets_are_failed_loads_with_nothing_written(caplog):
    """A ticket of a seq never published, one whose agent its metadata does not name, and a valid ticket given
    to a request of another prompt: failed loads (vLLM recomputes or fails them), the cache untouched."""
    src, src_slots, dst, p, c = _pair()
    ticket = _produce(p, "r1", PROMPT, src_slots)["kvx_ticket"]
    _refused(c, dst, {"kvx_ticket": {**ticket, "seq": ticket["seq"] + 5}}, PROMPT, caplog, "not published")
    _refused(c, dst, {"kvx_ticket": {**ticket, "agent": "kvx-someone-else"}}, PROMPT, caplog, "metadata names")
    _refused(c, dst, {"kvx_ticket": ticket}, OTHER, caplog, "other tokens")


def test_a_recycled_slot_fails_the_checks(caplog):
    """One slot, held 0 s: the next prompt takes the slot of the first before its consumer reads it. The first's
    lookup ticket then finds no bundle of its seq; a direct ticket of the first bundle (address and size) reads
    the second prompt's bytes, which the import refuses (other tokens). Nothing written either way."""
    src, src_slots, dst, p, c = _pair(slots=1, hold_s=0)
    ticket = _produce(p, "r1", PROMPT, src_slots)["kvx_ticket"]
    _, addr, nbytes = p._sender.directory[0].tolist()
    direct = {k: v for k, v in ticket.items() if k not in ("directory", "slots")} | {"addr": addr, "nbytes": nbytes}
    _produce(p, "r3", OTHER, src_slots)
    _refused(c, dst, {"kvx_ticket": ticket}, PROMPT, caplog, "not published")
    _refused(c, dst, {"kvx_ticket": direct}, PROMPT, caplog, "other tokens")


def test_a_producer_with_every_slot_held_publishes_nothing_and_keeps_the_held_bundles(caplog):
    """One slot held an hour: a second prompt is not published (logged); its consumer's load fails with nothing
    written, and the first prompt's ticket still loads."""
    src, src_slots, dst, p, c = _pair(slots=1)
    first = _produce(p, "r1", PROMPT, src_slots)
    with caplog.at_level(logging.ERROR):
        second = _produce(p, "r3", OTHER, src_slots)
    assert "saving its 40 prompt tokens failed" in caplog.text and "slots" in caplog.text
    _refused(c, dst, second, OTHER, caplog, "not published")
    n, failed, _ = _consume(c, "r4", PROMPT, first)
    assert (n, failed) == (len(PROMPT) - 1, set()) and _rows_equal(src, src_slots[:n], dst, _consumer_slots(n))


@pytest.mark.parametrize("opts", [SimpleNamespace(store="/dev/shm/kvx", kvtc=None),
                                  SimpleNamespace(store=None, kvtc="/cal")])
def test_nixl_startup_refusals(opts):
    with pytest.raises(ValueError, match="no store"):
        KvxConnector._check_nixl(opts)


def test_the_connector_starts_with_transport_nixl(checkpoint, tmp_path):
    """From vLLM's config: the scheduler opens no store; a kv_both worker opens its sender (slots as set) and
    receiver peers, and its handshake metadata gives the scheduler the sender's agent and slot directory."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvx_vllm import connector

    nixl = {"transport": "nixl", "nixl_buffer": "1MiB", "nixl_slots": 3, "nixl_hold_s": 5}
    sched = KvxConnector(_config(checkpoint, None, 1, **nixl), KVConnectorRole.SCHEDULER)
    worker = KvxConnector(_config(checkpoint, None, 1, **nixl), KVConnectorRole.WORKER)
    with mock.patch.object(connector, "LayerCaches"):
        worker.register_kv_caches({})
    assert sched.store is None and worker._sender.directory.shape[0] == 3 and worker._receiver is not None
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    assert sched._directories[0]["agent"] == worker._sender.name and "seq" not in sched._directories[0]


@pytest.mark.parametrize("kvx, store, refused", [
    ({"transport": "nixl"}, "kv", "takes no store"), ({"transport": "rdma"}, None, "transport must be one of"),
    ({"transport": "nixl", "nixl_slots": 0}, None, "nixl_slots must be"),
    ({"transport": "nixl", "nixl_buffer": "1.5GiB"}, None, "nixl_buffer must be"),
    ({"transport": "nixl", "nixl_hold_s": 1.5}, None, "nixl_hold_s must be"),
    ({"transport": "nixl", "nixl_memory": "gpu"}, None, "nixl_memory must be one of")])
def test_bad_nixl_settings_are_refused_at_startup(checkpoint, tmp_path, kvx, store, refused):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match=refused):
        KvxConnector(_config(checkpoint, store and tmp_path / store, 1, **kvx), KVConnectorRole.SCHEDULER)
    assert not (tmp_path / "kv").exists()


def test_device_memory_is_refused_at_startup_without_cuda(checkpoint, tmp_path):
    """nixl_memory "device" on a CPU-only platform: refused when the connector is built, naming the fix."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if torch.cuda.is_available():
        pytest.skip("this platform has CUDA: device memory is served")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match='no CUDA device; use nixl_memory "host"'):
            KvxConnector(_config(checkpoint, None, 1, transport="nixl", nixl_memory="device"), role)


def test_more_slots_than_a_peer_takes_are_refused_when_the_worker_starts(checkpoint):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvx_vllm import connector

    worker = KvxConnector(_config(checkpoint, None, 1, transport="nixl", nixl_buffer="1MiB", nixl_slots=5000),
                          KVConnectorRole.WORKER)
    with mock.patch.object(connector, "LayerCaches"), pytest.raises(ValueError, match="slots must be"):
        worker.register_kv_caches({})


# ---------------------------------------------------------------- tensor parallelism over NIXL
TP_PRODUCER_BLOCKS, TP_CONSUMER_BLOCKS = [2, 0, 3], [7, 5, 3, 1, 0]  # 8-token producer blocks, 4-token consumer ones


def _tp_slots(blocks: list[int], block_size: int, n: int) -> torch.Tensor:
    t = torch.arange(n)
    return torch.tensor(blocks)[t // block_size] * block_size + t % block_size


def _tp_step(ranks: list[KvxConnector], rid: str, prompt: list[int], blocks: list[int], computed: int = 0):
    """One scheduler step (rank 0's connector is the scheduler's) whose metadata every worker rank runs."""
    meta = _step(ranks[0], rid, prompt, blocks, computed)
    for r in ranks[1:]:
        r.bind_connector_metadata(meta)
    return meta


@pytest.mark.parametrize("producer_tp, consumer_tp", [(2, 1), (4, 2), (1, 2), (8, 4), (2, 4)])
def test_a_tensor_parallel_handoff_loads_every_consumer_rank_bit_for_bit(producer_tp, consumer_tp):
    """A TP=M producer publishes one shard per distinct KV-head range (TP 8 over 4 heads: ranks 0, 2, 4, 6) from
    each rank's own peer; the scheduler's ticket set names them; each rank of a TP=N consumer READs the shards
    holding its heads and imports them. Oracle: one full cache of the same K/V, sliced by head (nvfp4, same
    scales: bit for bit)."""
    from tests.transfer import test_tensor_parallel as tp

    data = tp._data(producer_tp)
    n, ids = tp.T - 1, list(range(500, 500 + tp.T))
    src_slots = _tp_slots(TP_PRODUCER_BLOCKS, 8, tp.T)
    full = tp._caches("nvfp4", (0, tp.H), *data, slots=src_slots)
    producers = [_connector(tp._caches("nvfp4", tp_head_range(tp.H, producer_tp, r), *data, slots=src_slots), 8,
                            producer=True, consumer=False, model=tp.MODEL, tp=(producer_tp, r))
                 for r in range(producer_tp)]
    producers[0].set_xfer_handshake_metadata({r: p.get_handshake_metadata() for r, p in enumerate(producers)})
    req = SimpleNamespace(request_id="t1", prompt_token_ids=ids, kv_transfer_params={"do_remote_decode": True},
                          sampling_params=None)
    producers[0].get_num_new_matched_tokens(req, 0)
    _tp_step(producers, "t1", ids, TP_PRODUCER_BLOCKS)
    for p in producers:
        p.wait_for_save()
        p.clear_connector_metadata()
    _, params = producers[0].request_finished(req, [])
    ticket = json.loads(json.dumps(params))["kvx_ticket"]
    publishers = sorted({min(r for r in range(producer_tp) if tp_head_range(tp.H, producer_tp, r) == h)
                         for h in (tp_head_range(tp.H, producer_tp, r) for r in range(producer_tp))})
    assert [1 in p._sender._seq for p in producers] == [r in publishers for r in range(producer_tp)]  # seq 1
    assert len(ticket.get("shards", [ticket])) == len(publishers)

    empty = torch.zeros(tp.LAYERS, 0, tp.H, tp.D)
    consumers = [_connector(tp._caches("nvfp4", tp_head_range(tp.H, consumer_tp, r), empty, empty, *data[2:],
                                       block_size=4), 4, producer=False, consumer=True, model=tp.MODEL,
                            tp=(consumer_tp, r)) for r in range(consumer_tp)]
    creq = SimpleNamespace(request_id="t1", prompt_token_ids=ids, kv_transfer_params={"kvx_ticket": ticket},
                           sampling_params=None)
    assert consumers[0].get_num_new_matched_tokens(creq, 0) == (n, False)
    consumers[0].update_state_after_alloc(creq, None, n)
    _tp_step(consumers, "t1", ids, TP_CONSUMER_BLOCKS, computed=n)
    dst_slots = _tp_slots(TP_CONSUMER_BLOCKS, 4, n)
    for c in consumers:
        reads, fetch = [], c._receiver.fetch
        c._receiver.fetch = lambda t, fetch=fetch, reads=reads, **kw: reads.append(kw) or fetch(t, **kw)
        c.start_load_kv(None)
        assert c.get_block_ids_with_load_errors() == set()
        a, b = c.kv_heads
        held = [tp_head_range(tp.H, producer_tp, r) for r in publishers]
        assert len(reads) == sum(h[0] < b and a < h[1] for h in held)  # only the shards holding its heads
        for layer in range(tp.LAYERS):
            got = read_rows(c._caches.cache.descriptor(layer), dst_slots)
            want = read_rows(full.descriptor(layer), src_slots[:n])
            for name, t in got.items():
                w = want[name][a:b] if name.endswith("global") else want[name][:, a:b]
                assert torch.equal(t.view(torch.uint8), w.contiguous().view(torch.uint8)), (c.tp_rank, layer, name)
    for r in publishers:  # every consumer rank that read a shard told its sender: all its slots released
        _wait_released(producers[r]._sender, 0)


def test_a_shard_read_by_two_consumer_ranks_is_held_until_both_read():
    """TP=1 producer, TP=2 consumer: each consumer rank READs the one bundle (readers=2 in its notification); the
    producer's slot stays held after the first READ and is released after the second."""
    from tests.transfer import test_tensor_parallel as tp

    data = tp._data(5)
    ids, src_slots = list(range(600, 600 + tp.T)), _tp_slots(TP_PRODUCER_BLOCKS, 8, tp.T)
    p = _connector(tp._caches("nvfp4", (0, tp.H), *data, slots=src_slots), 8, producer=True, consumer=False,
                   model=tp.MODEL)
    req = SimpleNamespace(request_id="h1", prompt_token_ids=ids, kv_transfer_params={"do_remote_decode": True},
                          sampling_params=None)
    p.get_num_new_matched_tokens(req, 0)
    _step(p, "h1", ids, TP_PRODUCER_BLOCKS)
    p.wait_for_save()
    _, params = p.request_finished(req, [])
    empty = torch.zeros(tp.LAYERS, 0, tp.H, tp.D)
    ranks = [_connector(tp._caches("nvfp4", tp_head_range(tp.H, 2, r), empty, empty, *data[2:], block_size=4), 4,
                        producer=False, consumer=True, model=tp.MODEL, tp=(2, r)) for r in range(2)]
    first = ranks[0]._fetch(params["kvx_ticket"])
    assert len(first) == 1
    time.sleep(0.5)  # the first READ's notification has had time to arrive
    assert p._sender.held_slots() == 1
    ranks[1]._fetch(params["kvx_ticket"])
    _wait_released(p._sender, 0)


def test_a_ticket_set_holding_none_of_a_ranks_heads_is_a_failed_load(caplog):
    """A well-formed set whose shards miss this consumer rank's KV heads: nothing is READ, the load fails, said."""
    from tests.transfer import test_tensor_parallel as tp

    p = _connector(tp._caches("nvfp4", (0, tp.H), *tp._data(1)), 8, producer=True, consumer=False, model=tp.MODEL)
    empty = torch.zeros(tp.LAYERS, 0, tp.H, tp.D)
    c = _connector(tp._caches("nvfp4", (2, 4), empty, empty, *tp._data(1)[2:], block_size=4), 4, producer=False,
                   consumer=True, model=tp.MODEL, tp=(2, 1))
    ticket = {"shards": [{**p._directories[0], "seq": 1, "kv_heads": [0, 2]}]}
    with pytest.raises(KvxError, match=r"none of this rank's KV heads \[2, 4\)"):
        c._fetch(ticket)


@pytest.mark.parametrize("forged", [
    {"shards": []}, {"shards": "x"}, {"shards": [{"kv_heads": [0, 2]}]}, {"shards": [], "agent": "a"},
    "overlap", "no heads", "bad heads"])
def test_a_forged_ticket_set_is_a_logged_miss(caplog, forged):
    from tests.transfer import test_tensor_parallel as tp

    p = _connector(tp._caches("nvfp4", (0, tp.H), *tp._data(1)), 8, producer=True, consumer=False, model=tp.MODEL)
    good = {**p._directories[0], "seq": 1}
    forged = {"overlap": {"shards": [{**good, "kv_heads": [0, 2]}, {**good, "kv_heads": [1, 3]}]},
              "no heads": {"shards": [good]},
              "bad heads": {"shards": [{**good, "kv_heads": [2, 1]}]}}.get(forged, forged) \
        if isinstance(forged, str) else forged
    c = _connector(tp._caches("nvfp4", (0, tp.H), *tp._data(1)), 8, producer=False, consumer=True, model=tp.MODEL)
    req = SimpleNamespace(request_id="f1", prompt_token_ids=list(range(tp.T)),
                          kv_transfer_params={"kvx_ticket": forged}, sampling_params=None)
    with caplog.at_level(logging.WARNING):
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "kvx_ticket is refused" in caplog.text
