"""`KvxConnector` (vLLM) over a shared store holding forged or unreadable entries: the scheduler side logs a miss and
computes the prompt, the worker side reports the request's blocks as failed loads; neither raises. The connector's
methods run on a stand-in for its state (no engine: these are the store-facing paths only)."""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401  (missing vLLM is an error: scripts/setup_vllm_env.sh installs it)

from kvx_core.cache import PagedKVCache
from kvx_core.transfer import ModelFingerprint, import_bundle
from kvx_core.transfer.store import BundleStore
from kvx_vllm.connector import KvxConnector, KvxConnectorMetadata, Transfer
from tests.fuzz import DEEP
from tests.transfer.forge import build, split

pytestmark = [pytest.mark.vllm]

PROMPT = list(range(500, 520))
MODEL = ModelFingerprint("LlamaForCausalLM", 2, 2, 32, {"rope_theta": 10000.0}, "c" * 64, "t" * 64)


def _state(tmp_path, forgery: str) -> SimpleNamespace:
    """The connector's fields its store paths read, over a store whose entry of PROMPT is forged by `forgery`."""
    store = BundleStore(tmp_path / "store")
    src = PagedKVCache("nvfp4", num_layers=2, num_blocks=2, block_size=16, num_kv_heads=2, head_dim=32)
    path = store.put([src.descriptor(i) for i in range(2)], torch.arange(len(PROMPT)), model=MODEL, token_ids=PROMPT)
    header, payloads = split(path.read_bytes())
    if forgery == "directory":
        path.unlink()
        path.mkdir()
    elif forgery == "kvtc garbage":
        path.write_bytes(b"KVTC" + bytes(64))
    else:
        header["model"]["rope"]["rope_theta"] = math.nan if forgery == "nan" else DEEP
        path.write_bytes(build(header, payloads))
    loads = KvxConnectorMetadata(loads=[Transfer("r1", PROMPT, list(range(16)), (0, 16))])
    dst = PagedKVCache("nvfp4", num_layers=2, num_blocks=2, block_size=16, num_kv_heads=2, head_dim=32)
    caches = SimpleNamespace(load=lambda f, slots, **kw: import_bundle(f, [dst.descriptor(i) for i in range(2)],
                                                                         slots, **kw), dst=dst)
    return SimpleNamespace(consumer=True, store=store, model=MODEL, _loads={}, block_size=16, _caches=caches,
                           _failed=set(), _get_connector_metadata=lambda: loads)


@pytest.mark.parametrize("forgery", ["nan", "deep", "directory", "kvtc garbage"])
def test_a_forged_entry_is_a_logged_miss_and_a_failed_load(tmp_path, caplog, forgery):
    state = _state(tmp_path, forgery)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=PROMPT, sampling_params=None)
    with caplog.at_level(logging.WARNING):
        assert KvxConnector.get_num_new_matched_tokens(state, request, 0) == (0, False)
        KvxConnector.start_load_kv(state, None)
    assert "store entry refused" in caplog.text and "loading 16 bundled tokens failed" in caplog.text
    assert state._failed == {0} and not state._loads
    assert all(not p.k_data.any() and not p.v_data.any() for p in state._caches.dst.layers)  # nothing written
