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
    return SimpleNamespace(consumer=True, nixl=None, store=store, model=MODEL, _loads={}, block_size=16,
                           _caches=caches, _failed=set(), _get_connector_metadata=lambda: loads)


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


def test_a_stored_prefix_is_reported_and_loaded_from_its_entry(tmp_path):
    """A prompt sharing 21 tokens with a stored 40-token entry (prefix block 8), 8 held locally: the scheduler
    reports tokens 8..16 (the shared whole blocks beyond what vLLM holds), the worker loads exactly those from the
    entry (its rows bit for bit; every other slot untouched)."""
    from kvx_core.transfer.rows import LAYER_TENSORS, read_rows

    store = BundleStore(tmp_path / "store", prefix_block=8)
    stored = list(range(600, 640))
    src = PagedKVCache("nvfp4", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        src.write(layer, torch.randn(40, 2, 32, generator=g), torch.randn(40, 2, 32, generator=g), torch.arange(40))
    store.put([src.descriptor(i) for i in range(2)], torch.arange(40), model=MODEL, token_ids=stored)
    prompt = stored[:21] + [1, 2, 3]
    dst = PagedKVCache("nvfp4", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=32)
    meta = KvxConnectorMetadata()
    state = SimpleNamespace(consumer=True, producer=False, nixl=None, store=store, model=MODEL, _loads={},
                            block_size=16, _prompts={"r1": prompt}, _blocks={"r1": [2, 3]}, _failed=set(),
                            kv_heads=(0, 2),
                            _caches=SimpleNamespace(load=lambda f, slots, **kw: import_bundle(
                                f, [dst.descriptor(i) for i in range(2)], slots, **kw)),
                            _get_connector_metadata=lambda: meta)
    state._slots = lambda rid, a, b: KvxConnector._slots(state, rid, a, b)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=prompt, sampling_params=None)
    assert KvxConnector.get_num_new_matched_tokens(state, request, 8) == (8, False)
    KvxConnector._plan(state, meta, "r1", 8, len(prompt) - 8)
    assert [(t.token_ids, t.slots, t.token_range) for t in meta.loads] == [(stored, list(range(40, 48)), (8, 16))]
    before = [read_rows(dst.descriptor(i), torch.arange(64)) for i in range(2)]
    KvxConnector.start_load_kv(state, None)
    assert not state._failed
    for layer in range(2):
        got = read_rows(dst.descriptor(layer), torch.arange(64))
        want = read_rows(src.descriptor(layer), torch.arange(8, 16))
        for name, t in got.items():
            if name in LAYER_TENSORS:  # per-layer scales, not per token
                continue
            assert torch.equal(t[40:48].view(torch.uint8), want[name].view(torch.uint8)), name
            rest = torch.cat([t[:40], t[48:]])
            assert torch.equal(rest.view(torch.uint8),
                               torch.cat([before[layer][name][:40], before[layer][name][48:]]).view(torch.uint8))
