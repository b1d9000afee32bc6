"""The KVX TensorRT-LLM connector driven through a contract shim of TRT-LLM's connector interface
(`trtllm_contract.py`: TRT-LLM's method names, data classes and call order; NOT TensorRT-LLM, which cannot be
installed here): a producer saves prompts computed in chunks, a consumer with another block size loads them, bundles
cross to vLLM-shaped pages and to a KVX NVFP4 cache and back, FP8 caches travel with their per-layer scales
(`KVX_KV_SCALES`), released (-1) blocks and damaged bundles are refused."""
from __future__ import annotations

import inspect
import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from kvx_adapters.vllm import from_vllm_kv_cache
from kvx_core.cache import PagedKVCache
from kvx_core.formats import get_format
from kvx_core.transfer import import_bundle
from kvx_trtllm.connector import KvxConnectorScheduler, KvxConnectorWorker

from .trtllm_contract import SCHEDULER_METHODS, WORKER_METHODS, ShimExecutor, ShimRequest

L, H, D = 2, 2, 16


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint directory as the fingerprint reads it: config.json + tokenizer.json."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": L,
                                               "num_attention_heads": 4, "num_key_value_heads": H, "head_dim": D,
                                               "hidden_size": 64, "rope_theta": 10000.0}))
    (d / "tokenizer.json").write_text('{"model": "shim"}')
    return str(d)


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "store"
    monkeypatch.setenv("KVX_STORE", str(root))
    return root


def _entries(store) -> list:
    return list(store.glob("*.kvx"))


def _args(model: str, tokens_per_block: int, **kw) -> SimpleNamespace:
    """The fields of TRT-LLM's TorchLlmArgs the connector reads."""
    return SimpleNamespace(model=model, kv_cache_config=SimpleNamespace(tokens_per_block=tokens_per_block),
                           tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=1,
                           max_beam_width=kw.get("beams", 1))


def _engine(model: str, t: int, *, chunk: int, blocks: int = 32) -> ShimExecutor:
    a = _args(model, t)
    return ShimExecutor(KvxConnectorScheduler(a), KvxConnectorWorker(a), num_blocks=blocks, num_layers=L, heads=H,
                        head_dim=D, tokens_per_block=t, chunk=chunk)


def _fp8_engine(model: str, t: int, scales: list[float], tmp_path, monkeypatch, *, chunk: int = 64) -> ShimExecutor:
    """An FP8 engine whose connector reads the layers' kv_scale_quant_orig from KVX_KV_SCALES."""
    f = tmp_path / f"scales{len(list(tmp_path.glob('scales*')))}.json"
    f.write_text(json.dumps(scales))
    monkeypatch.setenv("KVX_KV_SCALES", str(f))
    a = _args(model, t)
    e = ShimExecutor(KvxConnectorScheduler(a), KvxConnectorWorker(a), num_blocks=32, num_layers=L, heads=H,
                     head_dim=D, tokens_per_block=t, chunk=chunk, dtype=torch.float8_e4m3fn, kv_scales=scales)
    monkeypatch.delenv("KVX_KV_SCALES")
    return e


def test_methods_match_trtllm_signatures():
    for cls, methods in ((KvxConnectorWorker, WORKER_METHODS), (KvxConnectorScheduler, SCHEDULER_METHODS)):
        for name, params in methods.items():
            got = list(inspect.signature(getattr(cls, name)).parameters)[1:]
            assert got == params, (cls.__name__, name)


def test_producer_chunks_then_consumer_with_another_block_size_loads_exactly(checkpoint, store):
    prompt = list(range(3, 3 + 27))
    prod = _engine(checkpoint, 4, chunk=8)
    blocks = prod.run(ShimRequest(1, list(prompt)), decode_steps=2)
    assert torch.equal(prod.stored(blocks, len(prompt)), prod.expected(prompt, len(prompt)))
    assert len(_entries(store)) == 1  # saved once, in the step that computed the prompt's last token
    assert all(f == ([], []) for f in prod.finished)

    cons = _engine(checkpoint, 8, chunk=16)
    matched, _ = cons.sched.get_num_new_matched_tokens(ShimRequest(7, list(prompt)), 0)
    assert matched == 24  # whole blocks of 8, short of the last prompt token
    cons.sched.request_finished(ShimRequest(7, []), [])
    loaded = cons.run(ShimRequest(2, list(prompt)), decode_steps=1)
    assert torch.equal(cons.stored(loaded, len(prompt)), cons.expected(prompt, len(prompt)))
    # the consumer computed only the tokens after the loaded ones: loading nothing would leave zeros
    assert cons.stored(loaded, 24).abs().sum() > 0


def test_consumer_with_a_device_prefix_loads_only_the_rest(checkpoint, store):
    prompt = list(range(50, 50 + 20))
    _engine(checkpoint, 4, chunk=32).run(ShimRequest(1, list(prompt)))
    cons = _engine(checkpoint, 4, chunk=32)
    assert cons.sched.get_num_new_matched_tokens(ShimRequest(9, list(prompt)), 8) == (8, False)  # 16 - 8
    assert cons.sched.get_num_new_matched_tokens(ShimRequest(10, list(prompt)), 16) == (0, False)
    assert cons.sched.get_num_new_matched_tokens(ShimRequest(11, list(prompt[:10])), 0) == (0, False)  # other key


def test_trtllm_bundle_to_vllm_pages_and_back(checkpoint, store):
    prompt = list(range(100, 118))
    prod = _engine(checkpoint, 4, chunk=64)
    prod.run(ShimRequest(1, list(prompt)))
    cfg = prod.sched.config
    # into vLLM flash-attention pages [2, blocks, 16, H, D] (bf16: bit-identical rows)
    pages = [torch.zeros(2, 4, 16, H, D, dtype=torch.bfloat16) for _ in range(L)]
    slots = torch.tensor([17 + i for i in range(len(prompt))])  # from block 1, offset 1
    with cfg.store.open_entry(cfg.model, prompt) as f:
        import_bundle(f, [from_vllm_kv_cache(p) for p in pages], slots, model=cfg.model, token_ids=prompt)
    want = prod.expected(prompt, len(prompt))
    for layer, p in enumerate(pages):
        assert torch.equal(p.flatten(1, 2)[:, slots], want[layer])
    # vLLM -> store -> a fresh TRT-LLM consumer
    cfg.store.remove(cfg.model, prompt)
    cfg.store.put([from_vllm_kv_cache(p) for p in pages], slots, model=cfg.model, token_ids=prompt)
    cons = _engine(checkpoint, 16, chunk=64)
    blocks = cons.run(ShimRequest(2, list(prompt)))
    assert torch.equal(cons.stored(blocks, 16), want[:, :, :16])  # the loaded whole block


def test_trtllm_bf16_bundle_into_an_nvfp4_cache_equals_writing_it(checkpoint, store):
    prompt = list(range(7, 7 + 12))
    prod = _engine(checkpoint, 4, chunk=64)
    prod.run(ShimRequest(1, list(prompt)))
    cfg = prod.sched.config
    make = lambda: PagedKVCache("nvfp4", num_layers=L, num_blocks=2, block_size=16, num_kv_heads=H,  # noqa: E731
                                head_dim=D)
    got, ref = make(), make()
    slots = torch.arange(len(prompt))
    with cfg.store.open_entry(cfg.model, prompt) as f:
        import_bundle(f, [got.descriptor(i) for i in range(L)], slots, model=cfg.model, token_ids=prompt)
    for layer, (k, v) in enumerate(prod.expected(prompt, len(prompt))):  # [L, 2, n, H, D]
        ref.write(layer, k, v, slots)
    for layer in range(L):
        a, b = got.descriptor(layer), ref.descriptor(layer)
        assert torch.equal(a.k.tensor, b.k.tensor) and torch.equal(a.v.tensor, b.v.tensor)
        assert torch.equal(a.quant.k_scales.tensor, b.quant.k_scales.tensor)


FP8_SCALES = [0.25, 0.125]  # powers of two: FP8 * s is exact in bf16 and x / s exact before the FP8 rounding


def test_fp8_bundles_keep_the_bytes_and_scales(checkpoint, store, tmp_path, monkeypatch):
    """FP8 -> FP8 with the same scales is bit for bit; FP8 -> bf16 is the dequantized FP8 exactly."""
    prompt = list(range(40, 57))  # 17 tokens: consumers with blocks of 8 load 16
    prod = _fp8_engine(checkpoint, 4, FP8_SCALES, tmp_path, monkeypatch)
    sent = prod.stored(prod.run(ShimRequest(1, list(prompt))), 16)  # [L, 2, 16, H, D] FP8
    cfg = prod.sched.config
    assert cfg.store.header(cfg.model, prompt)["cache"]["format"] == "fp8_e4m3"
    cons = _fp8_engine(checkpoint, 8, FP8_SCALES, tmp_path, monkeypatch)
    got = cons.stored(cons.run(ShimRequest(2, list(prompt))), 16)
    assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
    bf16 = _engine(checkpoint, 8, chunk=64)
    got = bf16.stored(bf16.run(ShimRequest(3, list(prompt))), 16)
    want = (sent.float() * torch.tensor(FP8_SCALES).view(L, 1, 1, 1, 1)).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_a_bf16_bundle_loads_into_fp8_with_the_layers_scales(checkpoint, store, tmp_path, monkeypatch):
    """bf16 -> FP8 stores what encoding the bf16 K/V with each layer's scale gives (KVX's FP8 format, x / s)."""
    prompt = list(range(60, 77))
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(1, list(prompt)))
    scales = [0.5, 0.25]
    cons = _fp8_engine(checkpoint, 8, scales, tmp_path, monkeypatch)
    got = cons.stored(cons.run(ShimRequest(2, list(prompt))), 16)
    x = cons.expected(prompt, 16)  # [L, 2, n, H, D] bf16, what the producer computed
    fp8 = get_format("fp8_e4m3").k
    for layer, s in enumerate(scales):
        want, _ = fp8.encode(x[layer].flatten(0, 1), torch.full((H,), s))
        assert torch.equal(got[layer].flatten(0, 1).view(torch.uint8), want.view(torch.uint8)), layer


@pytest.mark.parametrize("scales,dtype,words", [
    (None, torch.float8_e4m3fn, "KVX_KV_SCALES"),
    ([0.5, 0.5, 0.5], torch.float8_e4m3fn, "3 values"),
    ([0.5, -1.0], torch.float8_e4m3fn, "finite positive"),
    ("not json", torch.float8_e4m3fn, "JSON"),
    ([0.5, 0.5], torch.bfloat16, "for FP8 caches"),
    (None, torch.uint8, "NVFP4"),
])
def test_fp8_scales_must_come_with_fp8_caches(checkpoint, store, tmp_path, monkeypatch, scales, dtype, words):
    if scales is not None:
        f = tmp_path / "scales.json"
        f.write_text(scales if isinstance(scales, str) else json.dumps(scales))
        monkeypatch.setenv("KVX_KV_SCALES", str(f))
    with pytest.raises(ValueError, match=words):
        w = KvxConnectorWorker(_args(checkpoint, 4))
        w.register_kv_caches(torch.zeros(4, L, 2, H * 4 * D, dtype=dtype))


def test_released_blocks_are_not_saved_and_cannot_be_loaded_into(checkpoint, store, caplog):
    prompt = list(range(200, 216))
    prod = _engine(checkpoint, 4, chunk=64)
    with caplog.at_level(logging.WARNING, logger="kvx_trtllm.connector"):
        prod.run(ShimRequest(1, list(prompt)), release={1})
    assert "released" in caplog.text and not _entries(store)
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(2, list(prompt)))  # saved this time
    cons = _engine(checkpoint, 4, chunk=64)
    with pytest.raises(RuntimeError, match="released"):
        cons.run(ShimRequest(3, list(prompt)), release={0})


def test_a_damaged_bundle_raises_and_writes_nothing(checkpoint, store):
    prompt = list(range(300, 320))
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(1, list(prompt)))
    cons = _engine(checkpoint, 4, chunk=64)
    path = cons.sched.config.store.path(cons.sched.config.model, prompt)
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0xFF  # a payload byte: the header still matches, the checksum does not
    path.write_bytes(bytes(raw))
    before = cons.pool.clone()
    with pytest.raises(RuntimeError, match="nothing written"):
        cons.run(ShimRequest(2, list(prompt)))
    assert torch.equal(cons.pool, before)


@pytest.mark.parametrize("forgery", ["nan", "deep", "huge count", "truncated", "directory"])
def test_a_forged_store_entry_is_a_logged_miss(checkpoint, store, caplog, forgery):
    """A forged entry in the shared store (checksums recomputed), a truncated one or a directory in its place: the
    scheduler logs it and computes the prompt (0 matched tokens), never crashes."""
    from tests.fuzz import DEEP
    from tests.transfer.forge import build, split

    prompt = list(range(400, 420))
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(1, list(prompt)))
    cons = _engine(checkpoint, 4, chunk=64)
    path = cons.sched.config.store.path(cons.sched.config.model, prompt)
    blob = path.read_bytes()
    header, payloads = split(blob)
    if forgery == "directory":
        path.unlink()
        path.mkdir()
    elif forgery == "truncated":
        path.write_bytes(blob[:-100])
    else:
        if forgery == "huge count":
            header["tokens"].update(count=2**24, ids=None, ids_sha256=None)
        else:
            header["model"]["rope"]["rope_theta"] = math.nan if forgery == "nan" else DEEP
        path.write_bytes(build(header, payloads))
    with caplog.at_level(logging.WARNING, logger="kvx_trtllm.connector"):
        assert cons.sched.get_num_new_matched_tokens(ShimRequest(7, list(prompt)), 0) == (0, False)
    assert "store entry refused" in caplog.text
    cons.sched.request_finished(ShimRequest(7, []), [])
    blocks = cons.run(ShimRequest(2, list(prompt)))
    assert torch.equal(cons.stored(blocks, len(prompt)), cons.expected(prompt, len(prompt)))


@pytest.mark.parametrize("change,words", [
    ({"KVX_STORE": None}, "KVX_STORE"),
    ({"KVX_ROLE": "sender"}, "KVX_ROLE"),
    ({"tp": 2}, "tensor_parallel_size"),
    ({"beams": 4}, "beam"),
    ({"model": "/nonexistent"}, "config.json"),
])
def test_bad_settings_are_refused_at_startup(checkpoint, store, monkeypatch, change, words):
    for k in ("KVX_STORE", "KVX_ROLE"):
        if k in change:
            if change[k] is None:
                monkeypatch.delenv(k)
            else:
                monkeypatch.setenv(k, change[k])
    a = _args(change.get("model", checkpoint), 4, **{k: v for k, v in change.items() if k in ("tp", "beams")})
    with pytest.raises(ValueError, match=words):
        KvxConnectorWorker(a)


def test_foreign_pools_are_refused(checkpoint, store):
    w = KvxConnectorWorker(_args(checkpoint, 4))
    with pytest.raises(ValueError, match="num_layers"):
        w.register_kv_caches(torch.zeros(4, L + 1, 2, H * 4 * D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K-only"):
        w.register_kv_caches(torch.zeros(4, L, 1, H * 4 * D, dtype=torch.bfloat16))


def test_consumer_role_never_saves_and_producer_never_loads(checkpoint, store, monkeypatch):
    prompt = list(range(400, 420))
    monkeypatch.setenv("KVX_ROLE", "consumer")
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(1, list(prompt)))
    assert not _entries(store)
    monkeypatch.setenv("KVX_ROLE", "producer")
    _engine(checkpoint, 4, chunk=64).run(ShimRequest(1, list(prompt)))
    prod = _engine(checkpoint, 4, chunk=64)
    assert prod.sched.get_num_new_matched_tokens(ShimRequest(2, list(prompt)), 0) == (0, False)


def test_kvtc_coded_entries_travel_between_engines(checkpoint, store, tmp_path, monkeypatch):
    """KVX_KVTC: the producer's entry is a KVTC buffer; a consumer with the same calibration loads exactly what
    writing the buffer's decompressed K/V gives, with the raw sink and recent tokens bit for bit; a consumer
    without it computes the prompt; a calibration of another geometry is refused at startup."""
    from dataclasses import asdict

    from kvx_core.kvtc import calibrate, decompress
    from kvx_core.transfer import fingerprint_from_files

    fp = fingerprint_from_files(f"{checkpoint}/config.json", f"{checkpoint}/tokenizer.json")
    g = torch.Generator().manual_seed(0)
    windows = [[(torch.randn(64, H, D, generator=g).bfloat16(), torch.randn(64, H, D, generator=g).bfloat16())
                for _ in range(L)] for _ in range(2)]
    cal = calibrate(windows, layers_per_group=2, ratio=4, range_size=8, sink_tokens=4, recent_tokens=8,
                    model=asdict(fp))
    cal.save(str(tmp_path / "cal.safetensors"))
    monkeypatch.setenv("KVX_KVTC", str(tmp_path / "cal.safetensors"))
    prompt = list(range(40, 40 + 33))
    _engine(checkpoint, 4, chunk=16).run(ShimRequest(1, list(prompt)))
    (entry,) = _entries(store)
    coded = entry.read_bytes()
    assert coded[:4] == b"KVTC"
    cons = _engine(checkpoint, 8, chunk=64)
    loaded = cons.run(ShimRequest(2, list(prompt)))
    got = cons.stored(loaded, 32)  # whole blocks of 8, short of the last prompt token
    _, kv, ids = decompress(coded, cal, model=asdict(fp))
    assert ids == prompt
    want = torch.stack([torch.stack([k[:32], v[:32]]) for k, v in kv]).to(got.dtype)
    assert torch.equal(got, want)
    exact = cons.expected(prompt, 32)
    raw = list(range(4)) + list(range(len(prompt) - 8, 32))  # sinks, and the recent window's tokens below 32
    assert torch.equal(got[:, :, raw], exact[:, :, raw]) and not torch.equal(got, exact)
    monkeypatch.delenv("KVX_KVTC")
    plain = _engine(checkpoint, 8, chunk=64)
    assert plain.sched.get_num_new_matched_tokens(ShimRequest(3, list(prompt)), 0) == (0, False)
    one_layer = calibrate([w[:1] for w in windows], layers_per_group=1, ratio=4, range_size=8, sink_tokens=4,
                          recent_tokens=8, model={})  # another geometry
    one_layer.save(str(tmp_path / "one_layer.safetensors"))
    monkeypatch.setenv("KVX_KVTC", str(tmp_path / "one_layer.safetensors"))
    with pytest.raises(ValueError, match="codes 1 layers"):
        KvxConnectorWorker(_args(checkpoint, 4))
