"""`KvxConnector` with tensor parallelism (CPU, no engine: the connector's methods run on a stand-in for each rank's
state, as in `test_vllm_connector_entries.py`). `tp_head_range` against vLLM's own split (`QKVParallelLinear` loading
a K weight whose rows name their head); TP=M producer ranks saving a prompt through `wait_for_save`, the scheduler
seeing the entry only once every shard is there, and every rank of a TP=N consumer loading its heads through
`start_load_kv` (oracle: one full cache holding the same K/V); a damaged shard fails the load on every consumer rank
with nothing written. Startup: a TP size that does not split the model's KV heads (and PP) refused; a worker's rank
and head range taken from vLLM's tensor-parallel group."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import vllm  # noqa: F401  (missing vLLM is an error: scripts/setup_vllm_env.sh installs it)

from kvx_core.transfer import export_bundle, import_bundle
from kvx_core.transfer.store import BundleStore
from kvx_core.transfer.tp import tp_head_range
from kvx_vllm.connector import KvxConnector, KvxConnectorMetadata, Transfer
from tests.transfer.test_tensor_parallel import LAYERS, MODEL, SLOTS, H, T, _caches, _data, _same_heads

pytestmark = [pytest.mark.vllm]

FMT = "nvfp4"
IDS = list(range(700, 700 + T))


def _vllm_heads(total_kv: int, tp: int, rank: int) -> list[int]:
    """The KV heads vLLM's QKVParallelLinear gives `rank` of `tp`: it loads a K weight whose rows hold their head
    index and we read back which rows it kept."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    d = 4
    patches = [mock.patch.object(m, f, return_value=v) for m in (linear, parameter)
               for f, v in (("get_tensor_model_parallel_world_size", tp), ("get_tensor_model_parallel_rank", rank))]
    with patches[0], patches[1], patches[2], patches[3], set_current_vllm_config(VllmConfig()):
        layer = linear.QKVParallelLinear(hidden_size=8, head_size=d, total_num_heads=2 * max(total_kv, tp),
                                         total_num_kv_heads=total_kv, bias=False, params_dtype=torch.float32)
    rows = torch.arange(total_kv).repeat_interleave(d).float()[:, None].expand(-1, 8).contiguous()
    layer.weight_loader(layer.weight, rows, "k")
    q = layer.num_heads * d
    return layer.weight.data[q:q + layer.num_kv_heads * d, 0].view(-1, d)[:, 0].long().tolist()


@pytest.mark.parametrize("total_kv, tp", [(1, 1), (1, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (4, 8), (2, 8),
                                          (8, 8), (3, 6)])
def test_head_ranges_are_vllms_split(total_kv, tp):
    for rank in range(tp):
        a, b = tp_head_range(total_kv, tp, rank)
        assert list(range(a, b)) == _vllm_heads(total_kv, tp, rank), rank


def _rank(store: BundleStore, tp: int, rank: int, cache, meta: KvxConnectorMetadata) -> SimpleNamespace:
    """The fields of one worker rank's connector that its save and load paths read (its cache: `cache`)."""
    descs = [cache.descriptor(i) for i in range(LAYERS)]
    caches = SimpleNamespace(export=lambda f, slots, **kw: export_bundle(f, descs, slots, **kw),
                             load=lambda src, slots, **kw: import_bundle(src, descs, slots, **kw))
    return SimpleNamespace(store=store, model=MODEL, tp_size=tp, tp_rank=rank, kv_heads=tp_head_range(H, tp, rank),
                           _caches=caches, block_size=8, _failed=set(), _get_connector_metadata=lambda: meta)


def _matched(store: BundleStore) -> tuple[int, bool]:
    """What the consumer's scheduler (one process) answers for a new request of IDS."""
    sched = SimpleNamespace(consumer=True, nixl=None, store=store, model=MODEL, _loads={})
    request = SimpleNamespace(request_id="r1", prompt_token_ids=IDS, sampling_params=None)
    return KvxConnector.get_num_new_matched_tokens(sched, request, 0)


def _produce(store: BundleStore, data, tp: int) -> None:
    meta = KvxConnectorMetadata(saves=[Transfer("r0", IDS, SLOTS.tolist())])
    for rank in range(tp):
        assert _matched(store) == (0, False)  # an incomplete set is no entry
        KvxConnector.wait_for_save(_rank(store, tp, rank, _caches(FMT, tp_head_range(H, tp, rank), *data), meta))
    assert _matched(store) == (T - 1, False)


def _consumers(store: BundleStore, data, tp: int) -> list[tuple[SimpleNamespace, object]]:
    """Each rank of a TP=`tp` consumer, after `start_load_kv` of IDS into a cache holding other K/V, with it."""
    meta = KvxConnectorMetadata(loads=[Transfer("r1", IDS, SLOTS.tolist(), (0, T))])
    out = []
    for rank in range(tp):
        cache = _caches(FMT, tp_head_range(H, tp, rank), *_data(99)[:2], data[2], data[3])
        state = _rank(store, tp, rank, cache, meta)
        KvxConnector.start_load_kv(state, None)
        out.append((state, cache))
    return out


@pytest.mark.parametrize("producer_tp", [1, 2, 4])
@pytest.mark.parametrize("consumer_tp", [1, 2, 4])
def test_a_tp_m_producer_hands_off_to_a_tp_n_consumer(tmp_path, producer_tp, consumer_tp):
    data = _data(11)
    full = _caches(FMT, (0, H), *data)
    store = BundleStore(tmp_path / "kv")
    _produce(store, data, producer_tp)
    for state, cache in _consumers(store, data, consumer_tp):
        assert state._failed == set()
        _same_heads(cache, full, state.kv_heads)


def test_a_damaged_shard_fails_the_load_on_every_rank(tmp_path, caplog):
    data = _data(12)
    store = BundleStore(tmp_path / "kv")
    _produce(store, data, 2)
    shard = next(store.root.glob("*.tp2-1.kvx"))
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x10
    shard.write_bytes(bytes(raw))
    for state, cache in _consumers(store, data, 2):
        untouched = _caches(FMT, state.kv_heads, *_data(99)[:2], data[2], data[3])
        assert state._failed == {s // 8 for s in SLOTS.tolist()}
        assert all(torch.equal(a, b) for p, q in zip(cache.layers, untouched.layers, strict=True)
                   for a, b in ((p.k_data, q.k_data), (p.v_data, q.v_data), (p.k_scales, q.k_scales)))
    assert caplog.text.count("checksum") == 2


def _config(checkpoint: str, store, tp: int, pp: int = 1, **kvx) -> SimpleNamespace:
    """The parts of a VllmConfig the connector reads, for SmolLM2 (3 KV heads) at TP `tp`, PP `pp`; the store (None:
    none) in the deprecated `kv_connector_extra_config` spelling (still read), `kvx`: `--additional-config` kvx
    settings."""
    from vllm.config import KVTransferConfig

    extra = {} if store is None else {"kvx_store": str(store)}
    return SimpleNamespace(
        model_config=SimpleNamespace(model=checkpoint, tokenizer=None, revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={}),
        additional_config={"kvx": kvx},
        kv_transfer_config=KVTransferConfig(kv_connector="KvxConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra))


@pytest.mark.parametrize("tp, pp, refused", [(2, 1, "3 KV heads do not split over 2"), (1, 2, "pipeline")])
def test_startup_refuses_a_tp_size_that_does_not_split_the_kv_heads_and_pp(checkpoint, tmp_path, tp, pp, refused):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match=refused):
        KvxConnector(_config(checkpoint, tmp_path / "kv", tp, pp), KVConnectorRole.SCHEDULER)


def test_store_prefix_block_and_size_cap_options(checkpoint, tmp_path):
    """The `store_prefix_block` / `store_max_bytes` settings reach the store; a value of the wrong type, or another
    block than the store records, is refused at startup (ValueError naming it) with no store created."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    c = KvxConnector(_config(checkpoint, tmp_path / "kv", 1, store_prefix_block=16, store_max_bytes="1MiB"),
                     KVConnectorRole.SCHEDULER)
    assert (c.store.prefix_block, c.store.max_bytes) == (16, 1 << 20)
    with pytest.raises(ValueError, match="prefix block is 16 tokens, 32 given"):
        KvxConnector(_config(checkpoint, tmp_path / "kv", 1, store_prefix_block=32), KVConnectorRole.SCHEDULER)
    bad = {"store_prefix_block": (0, -1, 1.5, True, "16", 2**61), "store_max_bytes": (0, -1, 1.5, True, "1.5GiB")}
    for key, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=f"additional_config.kvx.{key} must be"):
                KvxConnector(_config(checkpoint, tmp_path / "new", 1, **{key: value}), KVConnectorRole.SCHEDULER)
            assert not (tmp_path / "new").exists()


def test_a_worker_takes_its_rank_and_head_range_from_vllm(checkpoint, tmp_path):
    """TP 3 over SmolLM2's 3 KV heads: rank 2 holds head 2 (the rank from vLLM's tensor-parallel group)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvx_vllm import connector

    c = KvxConnector(_config(checkpoint, tmp_path / "kv", 3), KVConnectorRole.WORKER)
    with mock.patch("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=2), \
            mock.patch.object(connector, "LayerCaches"):
        c.register_kv_caches({})
    assert (c.tp_size, c.tp_rank, c.kv_heads) == (3, 2, (2, 3))
