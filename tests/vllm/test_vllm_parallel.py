"""vLLM's parallelism in the KVX plugin, on vLLM's own `ParallelConfig` (no engine run): the worker's tensor-parallel
rank that the calibration and the `KvxConnector` share (`kvx_vllm.parallel.tp_rank`: the rank in the TP group, also
under data parallelism, whose global rank differs), context parallelism refused by the backend and the connector
and pipeline parallelism refused by the connector (whatever the cache dtype and role, with no store created), data
parallelism started. Pipeline parallelism with a calibration file: tests/vllm/test_vllm_tp.py."""
from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from vllm.config import ParallelConfig

from .test_vllm_connector_tp import _config as connector_config
from .test_vllm_tp import HEAD_DIM, KV_HEADS, LAYERS, _config as calibration_config, _make_calibration

pytestmark = pytest.mark.vllm

GROUP_RANK = "vllm.distributed.parallel_state.get_tensor_model_parallel_rank"
"""vLLM's function for a worker's rank in its tensor-parallel group (patched: no process group here)."""


def _worker(config):
    """The worker-side connector of `config`, after vLLM registered its (here: no) caches."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvx_vllm import connector

    c = connector.KvxConnector(config, KVConnectorRole.WORKER)
    with mock.patch.object(connector, "LayerCaches"):
        c.register_kv_caches({})
    return c


def test_calibration_and_connector_take_the_tp_group_rank_under_data_parallelism(checkpoint, tmp_path, monkeypatch):
    """DP=2 x TP: replica 1's TP rank 1 has global rank 1 * TP + 1; both readers take the group rank (the file's rows
    of heads 2..3 of 4 at TP=2, SmolLM2's head 1 of 3 at TP=3)."""
    from kvx_core.formats import get_format
    from kvx_core.kv_calibration import FILENAME
    from kvx_vllm import calibration

    monkeypatch.setattr(calibration, "_loaded", {})
    cal = _make_calibration(tmp_path / FILENAME)
    cfg = calibration_config(str(tmp_path))
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1, rank=3)
    con = connector_config(checkpoint, tmp_path / "kv", 1)
    con.parallel_config = ParallelConfig(tensor_parallel_size=3, data_parallel_size=2, data_parallel_rank=1, rank=4)
    with mock.patch(GROUP_RANK, return_value=1):
        values = calibration.layer_values(cfg, get_format("nvfp4"), 2)
        worker = _worker(con)
    assert len(values) == LAYERS
    for i, lv in enumerate(values):
        assert lv.k_smoothing.shape == (2, HEAD_DIM)
        assert torch.equal(lv.k_smoothing, cal.smoothing[i][2:4])
        assert torch.equal(lv.k_center, cal.center[i][2:4])
        assert torch.equal(lv.k_global, cal.scales["nvfp4"][i][0][2:4])
    assert (worker.tp_rank, worker.kv_heads) == (1, (1, 2))


def test_without_tensor_parallelism_the_rank_is_0_without_asking_vllm(checkpoint, tmp_path, monkeypatch):
    """TP=1 (also with DP=2): every head, and vLLM's group (which a worker may not have set up) is not asked."""
    from kvx_core.formats import get_format
    from kvx_core.kv_calibration import FILENAME
    from kvx_vllm import calibration

    monkeypatch.setattr(calibration, "_loaded", {})
    cal = _make_calibration(tmp_path / FILENAME)
    cfg = calibration_config(str(tmp_path))
    cfg.parallel_config = ParallelConfig(data_parallel_size=2, data_parallel_rank=1, rank=1)
    con = connector_config(checkpoint, tmp_path / "kv", 1)
    con.parallel_config = cfg.parallel_config
    with mock.patch(GROUP_RANK, side_effect=AssertionError("asked")):
        values = calibration.layer_values(cfg, get_format("nvfp4"), KV_HEADS)
        worker = _worker(con)
    assert all(torch.equal(lv.k_smoothing, cal.smoothing[i]) for i, lv in enumerate(values))
    assert (worker.tp_rank, worker.kv_heads) == (0, (0, 3))


CONTEXT_PARALLEL = [(dict(tensor_parallel_size=2, decode_context_parallel_size=2), "--decode-context-parallel-size 2"),
                    (dict(prefill_context_parallel_size=2), "--prefill-context-parallel-size 2")]


@pytest.mark.parametrize("parallel, refused", [
    *((p, f"KVX connector: context parallelism ({flags}) is not served") for p, flags in CONTEXT_PARALLEL),
    (dict(pipeline_parallel_size=2), "KVX connector: pipeline parallelism is not served yet (a bundle holds every")])
@pytest.mark.parametrize("dtype", ["auto", "kvx_nvfp4"])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_context_and_pipeline_parallelism(checkpoint, tmp_path, parallel, refused, dtype, role):
    """Context parallelism (each rank's cache would hold every N-th token, and the connector saves and loads
    consecutive tokens) and pipeline parallelism (a bundle holds every layer) are refused whatever the cache dtype
    (vLLM's own caches too) and role, before the store is created."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvx_vllm.connector import KvxConnector

    cfg = connector_config(checkpoint, tmp_path / "kv", 1)
    cfg.parallel_config = ParallelConfig(**parallel)
    cfg.cache_config.cache_dtype = dtype
    with pytest.raises(ValueError, match=re.escape(refused)):
        KvxConnector(cfg, getattr(KVConnectorRole, role))
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("parallel, flags", CONTEXT_PARALLEL)
def test_the_backend_refuses_context_parallelism(parallel, flags):
    """The run's check (`options.check_config`, run when the KVX backend and its layers are built) on vLLM's own
    ParallelConfig fields."""
    from types import SimpleNamespace

    from kvx_vllm.options import check_config

    cfg = SimpleNamespace(additional_config=None, kv_transfer_config=None, speculative_config=None, model_config=None,
                          cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=None, cache_dtype="kvx_nvfp4"),
                          parallel_config=ParallelConfig(**parallel))
    with pytest.raises(ValueError, match=re.escape(f"cannot be used with: context parallelism ({flags})")):
        check_config(cfg)
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert check_config(cfg) == "nvfp4"
