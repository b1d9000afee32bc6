"""Forged bundles, store entries, token ids and NIXL tickets (a forger recomputes every checksum: `forge.py`): every
reader refuses them with a KvxError naming the field, before allocating what a header claims and before writing a
byte into a cache, an output buffer, a store entry or an output file; exports of layers with different block sizes
carry each layer's own rows."""
from __future__ import annotations

import base64
import io
import json
import math
import struct

import numpy as np
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import BundleReader, convert_bundle, export_bundle, import_bundle
from kvx_core.transfer.bundle import MAX_TOKENS
from kvx_core.transfer.host import export_to_host
from kvx_core.transfer.nixl import MAX_METADATA_CHARS, MAX_SLOTS, parse_ticket
from kvx_core.transfer.store import MARKER, BundleStore
from tests.fuzz import DEEP, run_capped

from .forge import build, split, tensor_at
from .test_bundle import DIM, HEADS, LAYERS, MODEL, _cache, _descs, _snapshot, _Trickle, _unchanged

IDS = [100, 101, 102]


def _transformed(tokens: int = 3) -> tuple[bytes, PagedKVCache]:
    """An NVFP4 bundle (per-head global scales, key smoothing and centering on every layer) of `tokens` tokens with
    their ids, and its source cache."""
    c = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=4, block_size=16, num_kv_heads=HEADS, head_dim=DIM,
                     per_head_global_scale=True)
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        c.set_global_scales(layer, torch.rand(HEADS, generator=g) * 0.01 + 0.002,
                            torch.rand(HEADS, generator=g) * 0.01 + 0.002)
        c.set_key_smoothing(layer, torch.rand(HEADS, DIM, generator=g) + 0.5)
        c.set_key_center(layer, torch.randn(HEADS, DIM, generator=g))
        c.write(layer, torch.randn(tokens, HEADS, DIM, generator=g), torch.randn(tokens, HEADS, DIM, generator=g),
                torch.arange(tokens))
    buf = io.BytesIO()
    export_bundle(buf, _descs(c), torch.arange(tokens), model=MODEL, token_ids=list(range(100, 100 + tokens)))
    return buf.getvalue(), c


@pytest.fixture(scope="module")
def transformed() -> bytes:
    return _transformed()[0]


@pytest.fixture
def dst() -> PagedKVCache:
    """A destination holding other data (what a refused import must leave as it is)."""
    return _cache("nvfp4", 16, 4, seed=9, tokens=10)[0]


def _cli(*argv: str) -> int:
    from kvx_cli.main import main  # noqa: PLC0415

    return main(list(argv))


def _all_readers_refuse(bad: bytes, dst: PagedKVCache, tmp_path, capsys, words: str, in_header: bool = True) -> None:
    """Import (stream, bytes, host tensor), convert, `kvx bundle verify | inspect | convert` and a store entry all
    refuse `bad` with INVALID_ARGUMENT (message holding `words`), and nothing changes: the destination, the output
    stream, no output file left. Not `in_header` (a layer's values): the header readers (inspect, `store.header`)
    read no chunk and accept it."""
    before = _snapshot(dst)
    for src in (io.BytesIO(bad), bad, torch.frombuffer(bytearray(bad), dtype=torch.uint8)):
        with pytest.raises(KvxError, match=words) as e:
            import_bundle(src, _descs(dst), torch.arange(3), model=MODEL)
        assert e.value.status == Status.INVALID_ARGUMENT
    assert _unchanged(dst, before)
    out = io.BytesIO()
    with pytest.raises(KvxError, match=words):
        convert_bundle(io.BytesIO(bad), out, "int8")
    assert out.getvalue() == b""
    path = tmp_path / "forged.kvx"
    path.write_bytes(bad)
    capsys.readouterr()
    for argv in (("verify", str(path)), ("inspect", str(path)), ("convert", str(path), str(tmp_path / "o.kvx"),
                                                                  "--format", "int8")):
        if argv[0] == "inspect" and not in_header:
            assert _cli("bundle", *argv) == 0
            capsys.readouterr()
            continue
        assert _cli("bundle", *argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "KVX bundle rejected" in err
    assert not (tmp_path / "o.kvx").exists() and path.read_bytes() == bad
    store = BundleStore(tmp_path / "store")
    store.path(MODEL, IDS).write_bytes(bad)
    if in_header:
        with pytest.raises(KvxError, match=words):
            store.header(MODEL, IDS)
    with pytest.raises(KvxError, match=words):
        store.get(_descs(dst), torch.arange(3), model=MODEL, token_ids=IDS)
    assert _unchanged(dst, before)


# ------------------------------------------------------------------ export: each layer's own rows, checked first
def _filled(block_size: int, num_blocks: int, seed: int) -> PagedKVCache:
    c = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=num_blocks, block_size=block_size, num_kv_heads=HEADS,
                     head_dim=DIM, per_head_global_scale=True)
    g = torch.Generator().manual_seed(seed)
    n = block_size * num_blocks
    for layer in range(LAYERS):
        c.write(layer, torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, HEADS, DIM, generator=g),
                torch.arange(n))
    return c


def test_export_gathers_each_layer_by_its_own_block_size():
    """Layer 0 in blocks of 16, layer 1 in blocks of 4: each layer's bundled rows are that layer's rows of the
    slots (the oracle reads the pools, `[block, head, offset]`, by slot), from host export and stream export alike."""
    a, b = _filled(16, 4, seed=1), _filled(4, 16, seed=2)
    caches, slots = [a.descriptor(0), b.descriptor(1)], torch.tensor([5, 17, 40, 63, 2])
    host = export_to_host(caches, slots, model=MODEL)
    stream = io.BytesIO()
    export_bundle(stream, caches, slots, model=MODEL)
    assert bytes(host.numpy()) == stream.getvalue()
    layers = BundleReader(io.BytesIO(stream.getvalue())).read_all()
    for layer, (cache, bs) in enumerate(((a, 16), (b, 4))):
        p = cache.layers[layer]
        for name, pool in (("k_data", p.k_data), ("v_data", p.v_data), ("k_scales", p.k_scales),
                           ("v_scales", p.v_scales)):
            want = torch.stack([pool[s // bs, :, s % bs] for s in slots.tolist()])
            assert torch.equal(layers[layer][name].view(torch.uint8), want.view(torch.uint8)), (layer, name)


def test_a_refused_export_writes_nothing():
    """Slots inside layer 0's cache but outside layer 1's: refused (OUT_OF_RANGE) before the first byte of `out` (a
    NIXL peer's published bundle) or of the stream is written."""
    caches, slots = [_filled(16, 4, seed=1).descriptor(0), _filled(16, 1, seed=2).descriptor(1)], torch.tensor([3, 40])
    out = torch.full((1 << 16,), 7, dtype=torch.uint8)
    with pytest.raises(KvxError, match="slots must lie in") as e:
        export_to_host(caches, slots, model=MODEL, out=out)
    assert e.value.status == Status.OUT_OF_RANGE and (out == 7).all()
    stream = io.BytesIO()
    with pytest.raises(KvxError) as e:
        export_bundle(stream, caches, slots, model=MODEL)
    assert e.value.status == Status.OUT_OF_RANGE and stream.getvalue() == b""


# ------------------------------------------------------------------ per-layer values: key vectors and scales
@pytest.mark.parametrize("name, value", [("k_smoothing", 0.0), ("k_smoothing", -1.0), ("k_smoothing", math.nan),
                                         ("k_smoothing", math.inf), ("k_center", math.nan), ("k_center", math.inf),
                                         ("k_center", -math.inf), ("k_global", 0.0), ("v_global", math.nan)])
def test_key_vectors_and_global_scales_outside_the_cache_rules_are_refused(transformed, dst, tmp_path, capsys, name,
                                                                           value):
    """A checksum-valid bundle whose layer 1 carries a smoothing vector that is not finite and > 0, a centering
    vector that is not finite, or such a global scale: the rule `QuantDesc` applies to a cache's own."""
    header, payloads = split(transformed)
    a, _ = tensor_at(header, name)
    layer1 = bytearray(payloads[1])
    layer1[a + 4:a + 8] = struct.pack("<f", value)  # element 1
    bad = build(header, [payloads[0], bytes(layer1)])
    _all_readers_refuse(bad, dst, tmp_path, capsys, f"layer 1's {name}", in_header=False)


# ------------------------------------------------------------------ one header schema for every reader
def _without(header: dict, payloads: list[bytes], name: str) -> list[bytes]:
    """`payloads` without tensor `name`'s bytes; `header` loses its entry (in place)."""
    a, b = tensor_at(header, name)
    header["tensors"] = [t for t in header["tensors"] if t["name"] != name]
    return [p[:a] + p[b:] for p in payloads]


@pytest.mark.parametrize("forgery, words", [
    ("smoothing flag without its vector", "do not match"), ("no head_dim", "geometry"),
    ("head_dim a string", "geometry"), ("model not an object", "model must be an object"),
    ("model without tokenizer hash", "model.tokenizer_sha256"), ("num_layers a bool", "model.num_layers"),
    ("kv_heads beyond the model", "geometry"), ("format not a name", "cache.format"),
    ("key_centering not a bool", "key_centering")])
def test_every_reader_refuses_a_header_import_refuses(transformed, dst, tmp_path, capsys, forgery, words):
    """Convert, verify, inspect and the store read headers with import's schema: a `key_smoothing: true` header
    without its vector (convert used to decode such keys unsmoothed), a header without `head_dim` (a KeyError),
    a model that is no fingerprint."""
    header, payloads = split(transformed)
    cache, model = header["cache"], header["model"]
    if forgery == "smoothing flag without its vector":
        payloads = _without(header, payloads, "k_smoothing")
    elif forgery == "no head_dim":
        del cache["head_dim"]
    elif forgery == "head_dim a string":
        cache["head_dim"] = "32"
    elif forgery == "model not an object":
        header["model"] = ["LlamaForCausalLM"]
    elif forgery == "model without tokenizer hash":
        del model["tokenizer_sha256"]
    elif forgery == "num_layers a bool":
        model["num_layers"] = True
    elif forgery == "kv_heads beyond the model":
        cache["kv_heads"], cache["num_kv_heads"] = [1, 3], 2
    elif forgery == "format not a name":
        cache["format"] = 4
    else:
        cache["key_centering"] = 1
    _all_readers_refuse(build(header, payloads), dst, tmp_path, capsys, words)


@pytest.mark.parametrize("forgery", ["one id short", "one id more", "an id changed", "a float id", "a negative id",
                                     "a bool id", "ids a string", "hash without ids not hex"])
def test_token_ids_must_match_their_count_and_hash(transformed, dst, tmp_path, capsys, forgery):
    header, payloads = split(transformed)
    tokens = header["tokens"]
    ids = tokens["ids"]
    if forgery == "one id short":
        ids.pop()
    elif forgery == "one id more":
        ids.append(7)
    elif forgery == "an id changed":
        ids[1] = 7  # the hash still names the original ids
    elif forgery == "a float id":
        ids[0] = 100.5
    elif forgery == "a negative id":
        ids[0] = -1
    elif forgery == "a bool id":
        ids[0] = True
    elif forgery == "ids a string":
        tokens["ids"] = "100,101,102"
    else:
        tokens["ids"], tokens["ids_sha256"] = None, "Z" * 64
    _all_readers_refuse(build(header, payloads), dst, tmp_path, capsys, "tokens")


def test_non_integer_token_ids_are_refused_never_truncated(tmp_path):
    """`put([1.5, 2, 3])` used to replace the entry of `[1, 2, 3]` (int() truncation): every entry point refuses a
    float, a bool or a string id, and nothing changes; integer ids of any integer type name the same entry."""
    store = BundleStore(tmp_path / "kv")
    src, slots = _cache("nvfp4", 16, 4, seed=1, tokens=3)
    entry = store.put(_descs(src), slots, model=MODEL, token_ids=[1, 2, 3]).read_bytes()
    other, _ = _cache("nvfp4", 16, 4, seed=2, tokens=3)
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    for bad in ([1.5, 2, 3], [1.0, 2, 3], [True, 2, 3], [1, 2, "3"], torch.tensor([1.5, 2.0, 3.0]),
                np.array([1.5, 2, 3]), 3):
        for call in (lambda: store.put(_descs(other), slots, model=MODEL, token_ids=bad),
                     lambda: store.header(MODEL, bad), lambda: BundleStore.key(MODEL, bad),
                     lambda: store.longest_prefix(MODEL, bad),
                     lambda: import_bundle(io.BytesIO(entry), _descs(dst), slots, model=MODEL, token_ids=bad)):
            with pytest.raises(KvxError, match="token ids must") as e:
                call()
            assert e.value.status == Status.INVALID_ARGUMENT
        out = io.BytesIO()
        with pytest.raises(KvxError):
            export_bundle(out, _descs(other), slots, model=MODEL, token_ids=bad)
        assert out.getvalue() == b""
    assert store.path(MODEL, [1, 2, 3]).read_bytes() == entry and _unchanged(dst, before)
    assert sorted(p.name for p in store.root.iterdir()) == sorted([MARKER, store.path(MODEL, [1, 2, 3]).name])
    key = BundleStore.key(MODEL, [1, 2, 3])
    assert BundleStore.key(MODEL, np.array([1, 2, 3])) == key == BundleStore.key(MODEL, torch.tensor([1, 2, 3]))


# ------------------------------------------------------------------ sizes: checked before anything is allocated
def _claims_many_tokens(count: int) -> bytes:
    """A ~1 kB BF16 bundle whose header claims `count` tokens (4 GiB per layer at 16M), its first chunk head claiming
    that payload, then 1000 bytes: what made readers allocate and zero the claimed size before reading."""
    src, slots = _cache("bf16", 16, 4, tokens=3)
    buf = io.BytesIO()
    export_bundle(buf, _descs(src), slots, model=MODEL)
    header, payloads = split(buf.getvalue())
    header["tokens"]["count"] = count
    head = build(header, [])[:-24]  # the prefix: magic, version, header, header hash
    size = count * 2 * HEADS * DIM * 2
    return head + b"KVXC" + struct.pack("<IQ", 0, size) + bytes(1000)


def claims_16m_tokens(rng) -> None:
    """Fuzz-harness target (one case, under the memory cap): every reader refuses a small bundle claiming 16M
    tokens without allocating its 4 GiB layers: from a file or buffer by its size, from a pipe when the bytes end."""
    import tempfile  # noqa: PLC0415

    bad = _claims_many_tokens(MAX_TOKENS)
    dst, _ = _cache("bf16", 16, 4, tokens=0)
    store = BundleStore(tempfile.mkdtemp())
    store.path(MODEL, IDS).write_bytes(bad)
    for read in (lambda: import_bundle(io.BytesIO(bad), _descs(dst), torch.arange(3), model=MODEL),
                 lambda: import_bundle(torch.frombuffer(bytearray(bad), dtype=torch.uint8), _descs(dst),
                                       torch.arange(3), model=MODEL),
                 lambda: BundleReader(_Trickle(bad)).read_all(), lambda: store.header(MODEL, IDS),
                 lambda: store.get(_descs(dst), torch.arange(3), model=MODEL, token_ids=IDS)):
        try:
            read()
        except KvxError as e:
            assert "truncated" in str(e), e
        else:
            raise AssertionError("a bundle claiming 16M tokens was accepted")


def test_a_small_bundle_claiming_16m_tokens_allocates_nothing():
    run_capped("tests.transfer.test_forged:claims_16m_tokens", cases=1)


def test_token_counts_above_the_cap_are_refused(dst, tmp_path, capsys):
    """2**31 - 1 tokens: refused by the header check (`MAX_TOKENS`), before the size check."""
    _all_readers_refuse(_claims_many_tokens(2**31 - 1), dst, tmp_path, capsys, "tokens.count")


def test_kvx_bundle_verify_of_a_pipe_like_claim_is_exit_2(tmp_path, capsys):
    path = tmp_path / "claim.kvx"
    path.write_bytes(_claims_many_tokens(MAX_TOKENS))
    assert _cli("bundle", "verify", str(path)) == 2
    assert "truncated" in capsys.readouterr().err


# ------------------------------------------------------------------ crashes that must be refusals
@pytest.mark.parametrize("poison", [math.nan, math.inf, DEEP])
def test_nan_infinity_and_deep_nesting_in_a_header_are_refused(transformed, dst, tmp_path, capsys, poison):
    header, payloads = split(transformed)
    header["model"]["rope"]["rope_theta"] = poison
    _all_readers_refuse(build(header, payloads), dst, tmp_path, capsys, "not valid JSON|nests deeper")


def test_a_directory_at_a_store_entry_is_refused_not_a_crash(tmp_path):
    store = BundleStore(tmp_path / "kv")
    store.path(MODEL, IDS).mkdir()
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    assert (MODEL, IDS) not in store
    src, slots = _cache("nvfp4", 16, 4, tokens=3)
    for call in (lambda: store.header(MODEL, IDS), lambda: store.open_entry(MODEL, IDS),
                 lambda: store.get(_descs(dst), torch.arange(3), model=MODEL, token_ids=IDS),
                 lambda: store.remove(MODEL, IDS),
                 lambda: store.put(_descs(src), slots, model=MODEL, token_ids=IDS)):
        with pytest.raises(KvxError, match="bundle store entry") as e:
            call()
        assert e.value.status == Status.INVALID_ARGUMENT
    assert _unchanged(dst, before) and store.path(MODEL, IDS).is_dir()
    assert not list(store.root.glob(".tmp-*"))


def test_import_takes_bytes_and_refuses_what_is_no_bundle(transformed):
    """`import_bundle(bytes)` imports like the stream; anything that is no bundle is INVALID_ARGUMENT."""
    a, b = (_cache("nvfp4", 16, 4, seed=9, tokens=10)[0] for _ in range(2))
    import_bundle(transformed, _descs(a), torch.arange(3), model=MODEL)
    import_bundle(io.BytesIO(transformed), _descs(b), torch.arange(3), model=MODEL)
    assert _unchanged(a, _snapshot(b))
    before = _snapshot(a)
    for bad in (123, None, "bundle.kvx", [], [123], {"a": 1}):
        with pytest.raises(KvxError) as e:
            import_bundle(bad, _descs(a), torch.arange(3), model=MODEL)
        assert e.value.status == Status.INVALID_ARGUMENT
    assert _unchanged(a, before)


# ------------------------------------------------------------------ NIXL tickets
TICKET = {"agent": "kvx-send", "nbytes": 4096, "addr": 140_000_000_000, "seq": 3,
          "metadata": base64.b64encode(b"nixl agent metadata").decode()}
LOOKUP = {"agent": "kvx-send", "seq": 3, "directory": 140_000_000_000, "slots": 8,
          "metadata": base64.b64encode(b"nixl agent metadata").decode()}


def test_a_ticket_parses_from_a_dict_or_its_json():
    for t in (TICKET, json.dumps(TICKET), json.dumps(TICKET).encode()):
        p = parse_ticket(t)
        assert (p.agent, p.nbytes, p.addr, p.seq, p.metadata) == ("kvx-send", 4096, 140_000_000_000, 3,
                                                                  b"nixl agent metadata")
    p = parse_ticket(json.dumps(LOOKUP))
    assert (p.directory, p.slots, p.nbytes, p.addr) == (140_000_000_000, 8, None, None)


@pytest.mark.parametrize("field, value", [
    ("nbytes", math.inf), ("nbytes", math.nan), ("nbytes", 1.5), ("nbytes", "4096"), ("nbytes", True), ("nbytes", 0),
    ("nbytes", -1), ("nbytes", 2**63), ("addr", -1), ("addr", 2**64), ("addr", 4096.0), ("agent", ""), ("agent", 7),
    ("agent", "x" * 1000), ("metadata", "!!not base64!!"), ("metadata", ""), ("metadata", None),
    ("metadata", "A" * (MAX_METADATA_CHARS + 4)), ("descs", "gASV"), ("addr", None), ("seq", None), ("seq", -1),
    ("seq", 2**63), ("seq", 3.0), ("seq", False)])
def test_every_ticket_field_is_checked(field, value):
    """A ticket field missing, of another type or out of range: INVALID_ARGUMENT naming it (the pickled NIXL
    descriptor list of older tickets is never read: `addr` is required)."""
    bad = {**TICKET, field: value}
    if value is None or field == "descs":
        bad.pop("addr" if field == "descs" else field)
    with pytest.raises(KvxError, match="ticket") as e:
        parse_ticket(bad)
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError, match="ticket"):
        parse_ticket(json.dumps(bad, allow_nan=True))


@pytest.mark.parametrize("field, value", [("directory", -1), ("directory", 2**64), ("directory", 1.0),
                                          ("directory", None), ("slots", 0), ("slots", MAX_SLOTS + 1),
                                          ("slots", "8"), ("slots", None), ("seq", None), ("metadata", None)])
def test_every_lookup_ticket_field_is_checked(field, value):
    """A lookup ticket (its bundle found by seq in the sender's directory) with a field missing, of another type or
    out of range: INVALID_ARGUMENT naming it, before any READ (slots capped: the directory READ is sized by it)."""
    bad = {**LOOKUP, field: value}
    if value is None:
        bad.pop(field)
    with pytest.raises(KvxError, match="ticket") as e:
        parse_ticket(bad)
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("text", ['{"agent": "a", "nbytes": Infinity, "addr": 0, "metadata": "AA=="}',
                                  "[" * 100_000 + "]" * 100_000, "[1, 2]", b"\xff\xfe"])
def test_a_ticket_that_is_no_strict_json_object_is_refused(text):
    with pytest.raises(KvxError) as e:
        parse_ticket(text)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_the_forger_models_the_format():
    """The forger rebuilds a valid bundle byte for byte (so its forgeries differ only where they are edited)."""
    blob, _ = _transformed()
    header, payloads = split(blob)
    assert build(header, payloads) == blob and len(payloads) == LAYERS


# ------------------------------------------------------------------ a checkpoint's config.json
@pytest.mark.parametrize("change", [{"num_hidden_layers": 2.5}, {"num_hidden_layers": "2"}, {"num_hidden_layers": True},
                                    {"num_key_value_heads": 0}, {"head_dim": 64.9}, {"num_hidden_layers": None},
                                    {"architectures": "Llama"}, {"head_dim": None, "hidden_size": 102},
                                    {"rope_theta": math.nan}])
def test_a_config_json_with_non_integer_counts_is_refused(tmp_path, change):
    """The fingerprint's counts are integers as written (never `int()`-truncated), the file strict JSON."""
    from kvx_core.transfer import fingerprint_from_files  # noqa: PLC0415

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 128, "rope_theta": 10000.0}
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    good = fingerprint_from_files(str(tmp_path / "config.json"), str(tmp_path / "tokenizer.json"))
    assert (good.num_layers, good.num_kv_heads, good.head_dim) == (2, 2, 32)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in {**cfg, **change}.items() if v is not None}))
    with pytest.raises(KvxError) as e:
        fingerprint_from_files(str(tmp_path / "config.json"), str(tmp_path / "tokenizer.json"))
    assert e.value.status == Status.INVALID_ARGUMENT
