"""`kvx kvtc calibrate | compress | inspect` on a tiny local Llama checkpoint and a KVX bundle of it: new files
only, one-line refusals (exit 2), and a compressed bundle that decompresses to the bundle's KV within the codec's
error."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvx_cli.main import main
from kvx_core.cache import PagedKVCache
from kvx_core.kvtc import decompress, load_calibration
from kvx_core.transfer import export_bundle, fingerprint_from_files, import_bundle

from ..tiny_llama import tiny_llama_fixture

tiny = tiny_llama_fixture()  # 2 layers, 2 KV heads x 16


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
    for (k, v), (k2, v2) in zip(kv, back, strict=True):  # raw sinks and recent tokens exact
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


# ------------------------------------------------------------------ refusals change nothing
def _one_line_refusal(argv, capsys, *words) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture
def small_cal(tmp_path):
    """The forgers' small calibration (tests/kvtc/forge.py) as a file, and a valid buffer of it."""
    from .forge import buffers, calibration

    path = tmp_path / "small_cal.safetensors"
    calibration().save(str(path))
    return path, buffers()


def test_decompress_leaves_nothing_when_the_input_is_refused(small_cal, tmp_path, capsys):
    from .forge import forge, raw_body, with_raw_body

    cal, bufs = small_cal
    out = tmp_path / "out" / "back.kvxb"
    out.parent.mkdir()
    good = bufs[0]  # of the calibration's model, no token ids: the body starts with the raw tokens
    nan = b"\xc0\x7f" + raw_body(good)[2:]  # the first raw bf16 value NaN: refused while the bundle is written
    inputs = {"junk": b"junk" * 20, "token_start near 2^64": forge(good, token_start=2**64 - 1),
              "truncated": good[:-1], "decodes to NaN": with_raw_body(good, nan)}
    for name, data in inputs.items():
        src = tmp_path / f"{name}.kvtc"
        src.write_bytes(data)
        _one_line_refusal(["kvtc", "decompress", str(cal), str(src), str(out)], capsys, "KVTC")
        assert list(out.parent.iterdir()) == [], name  # no output, no temporary file
    src = tmp_path / "good.kvtc"
    src.write_bytes(good)
    assert main(["kvtc", "decompress", str(cal), str(src), str(out)]) == 0
    written = out.read_bytes()
    assert written[:4] != b"KVTC" and [p.name for p in out.parent.iterdir()] == ["back.kvxb"]
    _one_line_refusal(["kvtc", "decompress", str(cal), str(src), str(out)], capsys, "exists")
    assert out.read_bytes() == written  # never replaced


@pytest.mark.parametrize("action", ["compress", "decompress"])
def test_the_output_path_is_checked_before_any_work(action, tmp_path, capsys):
    """A missing directory, a dangling symlink, an existing file or a directory as OUT: one line, exit 2, before the
    (missing) calibration is even opened, and nothing changed."""
    (tmp_path / "existing").write_bytes(b"user data")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "adir").mkdir()
    cases = {"no/such/dir/out": "no such directory", "dangling": "exists", "existing": "exists",
             "adir": "is a directory"}
    for out, words in cases.items():
        _one_line_refusal(["kvtc", action, "/nonexistent/cal.safetensors", "/nonexistent/in", str(tmp_path / out)],
                          capsys, words)
    assert (tmp_path / "existing").read_bytes() == b"user data"
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "dangling").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "dangling", "existing"]


@pytest.mark.parametrize("extra,words", [
    (["--sink", "1000", "--window-len", "128"], "--sink 1000"),
    (["--recent", "-5"], "--recent"),
    (["--ratio", "inf"], "--ratio"),
    (["--ratio", "nan"], "--ratio"),
    (["--ratio", "0.5"], "--ratio"),
    (["--range-size", "6"], "--range-size 6"),
    (["--layers-per-group", "0"], "--layers-per-group"),
    (["--windows", "0"], "--windows"),
    (["--window-len", "1"], "--window-len"),
    ([], "not a directory holding a Hugging Face checkpoint"),
])
def test_calibrate_checks_every_argument_before_loading_a_model(extra, words, tmp_path, capsys):
    out = tmp_path / "cal.safetensors"
    _one_line_refusal(["kvtc", "calibrate", str(out), "--model", str(tmp_path / "no-model"), *extra], capsys, words)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_calibrate_checks_the_group_size_against_the_model_before_loading_it(tiny, tmp_path, capsys):
    out = tmp_path / "cal.safetensors"
    _one_line_refusal(["kvtc", "calibrate", str(out), "--model", str(tiny), "--layers-per-group", "3"], capsys,
                      "does not divide the model's 2 layers")
    assert not out.exists()


def inspect_target(rng) -> None:
    """Run under the fuzz harness's memory cap: `kvx kvtc inspect` of a 3 GiB file (sparse) whose header is bad or
    declares a body larger than the file must refuse it (exit 2) without reading it."""
    import os

    for path in os.environ["KVX_TEST_HUGE"].split(os.pathsep):
        assert main(["kvtc", "inspect", path]) == 2, path


def test_inspect_reads_the_header_first(small_cal, tmp_path):
    from kvx_core.kvtc.codec import HEADER

    from ..fuzz import run_capped
    from .forge import forge

    _, bufs = small_cal
    paths = []
    for name, head in {"junk": b"junk" * 40, "too long": forge(bufs[0], body_bytes=(3 << 30) - 500)[:HEADER.size],
                       "cut": forge(bufs[0], body_bytes=(3 << 30) + 500)[:HEADER.size]}.items():
        p = tmp_path / name
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(3 << 30)  # sparse: no disk used
        paths.append(str(p))
    run_capped("tests.kvtc.test_kvtc_cli:inspect_target", cases=1, env={"KVX_TEST_HUGE": os.pathsep.join(paths)})


def test_end_to_end_from_the_command_line(tiny, tmp_path, capsys):
    """No Python: `kvx bundle export` makes the bundle that `kvx kvtc compress` codes and `decompress` gives back
    as a verified bundle; the calibration reports its progress with --progress and is mode 0644 under umask 022
    (it was 0600)."""
    text = tmp_path / "t.txt"
    text.write_text("Rain on the tin roof kept time with the kettle while the radio hummed. " * 6)
    cal, bundle = tmp_path / "cal.safetensors", tmp_path / "seq.kvxb"
    old = os.umask(0o022)
    try:
        assert main(["kvtc", "calibrate", str(cal), "--model", str(tiny), "--windows", "2", "--window-len", "128",
                     "--layers-per-group", "2", "--range-size", "8", "--ratio", "4", "--recent", "8",
                     "--progress"]) == 0
    finally:
        os.umask(old)
    err = capsys.readouterr().err
    assert "kvtc calibrate: K/V of window: 1/2" in err and "fitting layer group: 1/1" in err and "left" in err
    assert os.stat(cal).st_mode & 0o777 == 0o644
    assert main(["bundle", "export", str(bundle), "--model", str(tiny), "--text", str(text), "--tokens", "64"]) == 0
    assert main(["kvtc", "compress", str(cal), str(bundle), str(tmp_path / "seq.kvtc")]) == 0
    assert main(["kvtc", "decompress", str(cal), str(tmp_path / "seq.kvtc"), str(tmp_path / "back.kvxb")]) == 0
    assert main(["bundle", "verify", str(tmp_path / "back.kvxb")]) == 0
    assert "64 tokens, every checksum verified" in capsys.readouterr().out
