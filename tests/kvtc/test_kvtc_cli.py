"""`kvx kvtc calibrate | compress | inspect` on a tiny local Llama checkpoint and a KVX bundle of it: new files
only, one-line refusals (exit 2), and a compressed bundle that decompresses to the bundle's KV within the codec's
error."""
from __future__ import annotations

import json

import pytest
import torch

from kvx_cli.main import main
from kvx_core.cache import PagedKVCache
from kvx_core.kvtc import decompress, load_calibration
from kvx_core.transfer import export_bundle, fingerprint_from_files, import_bundle

from ..tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (2 layers, 2 KV heads x 16)."""
    pytest.importorskip("transformers")
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-kvtc"), hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256)


def test_calibrate_compress_inspect(tiny, tmp_path, capsys):
    cal = tmp_path / "cal.safetensors"
    args = ["kvtc", "calibrate", str(cal), "--model", str(tiny), "--windows", "2", "--window-len", "128",
            "--layers-per-group", "2", "--range-size", "8", "--ratio", "4", "--recent", "8"]
    assert main(args) == 0
    c = load_calibration(str(cal))
    assert c.num_layers == 2 and c.model["num_kv_heads"] == 2
    assert main(args) == 2 and "exists" in capsys.readouterr().err  # never overwritten

    # a bundle of 40 tokens of random KV in bf16, exported from a KVX cache
    model = fingerprint_from_files(str(tiny / "config.json"), str(tiny / "tokenizer.json"))
    cache = PagedKVCache("bf16", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(1)
    kv = [(torch.randn(40, 2, 16, generator=g).bfloat16(), torch.randn(40, 2, 16, generator=g).bfloat16())
          for _ in range(2)]
    slots = torch.arange(40)
    for i, (k, v) in enumerate(kv):
        cache.write(i, k, v, slots)
    bundle = tmp_path / "seq.kvxb"
    ids = list(range(100, 140))
    with open(bundle, "wb") as f:
        export_bundle(f, [cache.descriptor(i) for i in range(2)], slots, model=model, token_ids=ids)
    out = tmp_path / "seq.kvtc"
    assert main(["kvtc", "compress", str(cal), str(bundle), str(out), "--deflate"]) == 0
    hdr, back, _ = decompress(out.read_bytes(), c, model=model)
    assert hdr.token_count == 40 and hdr.flags == 3  # DEFLATE, token ids carried
    for (k, v), (k2, v2) in zip(kv, back):  # raw sinks and recent tokens exact
        assert torch.equal(k[:4], k2[:4]) and torch.equal(v[-8:], v2[-8:])
    capsys.readouterr()
    assert main(["kvtc", "inspect", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["token_count"] == 40 and shown["calibration"] == c.identity and shown["deflate"] is True
    assert shown["token_ids"] is True

    # back to a bundle any engine imports: same model and token ids, raw tokens exact
    again = tmp_path / "again.kvxb"
    assert main(["kvtc", "decompress", str(cal), str(out), str(again)]) == 0
    dest = PagedKVCache("bf16", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2,
                        head_dim=16)
    with open(again, "rb") as f:
        import_bundle(f, [dest.descriptor(i) for i in range(2)], slots, model=model, token_ids=ids)
    for layer, (k, v) in enumerate(back):
        got = dest.gather(layer, torch.tensor([[0, 1, 2]]), torch.tensor([40]), out_dtype=torch.bfloat16)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert main(["kvtc", "decompress", str(cal), str(out), str(again)]) == 2  # never overwritten


@pytest.mark.parametrize("argv,words", [
    (["kvtc", "inspect", "/nonexistent"], "no such file"),
    (["kvtc", "compress", "a"], "CAL BUNDLE OUT"),
    (["kvtc", "inspect", "__FILE__"], "not a KVTC buffer"),
])
def test_refusals_are_one_line(argv, words, tmp_path, capsys):
    f = tmp_path / "junk"
    f.write_bytes(b"junk" * 20)
    argv = [str(f) if a == "__FILE__" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
