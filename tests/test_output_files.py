"""Files KVX writes are readable like any file the user writes (mode 0o666 & ~umask, not a temporary file's 0600:
a server running as another user reads a calibration or a store entry); which KVX file a path holds (a command
given another kind names it and its reader); the calibration file's `sample` metadata (outside input: checked like
the rest); the default calibration file name and the older one; the progress lines of long commands."""
from __future__ import annotations

import io
import json
import os
import stat
import struct

import pytest
import torch

from kvx_cli.filekind import expect_kind, file_kind
from kvx_cli.main import main
from kvx_cli.progress import Progress
from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.kv_calibration import (
    FILENAME,
    LEGACY_FILENAME,
    SAMPLE_KEY,
    KvCalibration,
    default_file,
    load_kv_calibration,
)
from kvx_core.tensor_file import write_tensor_file
from kvx_core.transfer import ModelFingerprint, export_bundle
from kvx_core.transfer.store import BundleStore

H, D = 2, 16
MODEL = ModelFingerprint("LlamaForCausalLM", 1, H, D, {}, "c" * 64, "t" * 64)


def _cal(sample: dict | None = None) -> KvCalibration:
    return KvCalibration(1, H, D, {}, 0.25, None, (torch.linspace(0.5, 1.5, H * D).reshape(H, D),), sample=sample)


@pytest.fixture
def umask():
    """Set the process umask for the test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_published_files_follow_the_umask(tmp_path, umask, mask, mode):
    """Safetensors files (KV-cache and KVTC calibrations: `write_tensor_file`) and store entries were 0600."""
    umask(mask)
    cal_path = tmp_path / "c.kvxcal"
    _cal().save(str(cal_path))
    write_tensor_file(str(tmp_path / "t.safetensors"), {"a": torch.zeros(2)}, {})
    cache = PagedKVCache("bf16", num_layers=1, num_blocks=1, block_size=16, num_kv_heads=H, head_dim=D)
    entry = BundleStore(tmp_path / "store").put([cache.descriptor(0)], torch.arange(4), model=MODEL,
                                                token_ids=[1, 2, 3, 4])
    assert [_mode(p) for p in (cal_path, tmp_path / "t.safetensors", entry)] == [mode] * 3


def test_kvtc_and_bundle_cli_outputs_follow_the_umask(tmp_path, umask):
    """`kvx bundle convert` and the `files.publish` writers of `kvx kvtc` (compress / decompress) under umask 022."""
    umask(0o022)
    cache = PagedKVCache("bf16", num_layers=1, num_blocks=1, block_size=16, num_kv_heads=H, head_dim=D)
    src = tmp_path / "a.kvxb"
    with open(src, "wb") as f:
        export_bundle(f, [cache.descriptor(0)], torch.arange(4), model=MODEL)
    assert main(["bundle", "convert", str(src), str(tmp_path / "b.kvxb"), "--format", "nvfp4"]) == 0
    assert _mode(tmp_path / "b.kvxb") == 0o644


# ---------------------------------------------------------------- file kinds
def _bundle(path) -> None:
    cache = PagedKVCache("bf16", num_layers=1, num_blocks=1, block_size=16, num_kv_heads=H, head_dim=D)
    with open(path, "wb") as f:
        export_bundle(f, [cache.descriptor(0)], torch.arange(4), model=MODEL)


def test_each_command_names_another_kind_of_kvx_file(tmp_path, capsys):
    """`kvx bundle inspect` on a calibration file said "bad magic"; now every reader names the file's kind and the
    command that reads it, in one line, exit 2, and the file is unchanged."""
    cal, bundle = tmp_path / "c.kvxcal", tmp_path / "b.kvxb"
    _cal().save(str(cal))
    _bundle(bundle)
    before = {p: p.read_bytes() for p in (cal, bundle)}
    assert (file_kind(str(cal)), file_kind(str(bundle))) == ("kv-calibration", "bundle")
    for args, says in ((["bundle", "inspect", str(cal)], "kvx calibrate-kv inspect"),
                       (["bundle", "verify", str(cal)], "kvx calibrate-kv inspect"),
                       (["kvtc", "inspect", str(cal)], "kvx calibrate-kv inspect"),
                       (["calibrate-kv", "inspect", str(bundle)], "kvx bundle inspect"),
                       (["kvtc", "compress", str(cal), str(bundle), str(tmp_path / "o.kvtc")], "KV-cache calibration")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (args, err)
    assert {p: p.read_bytes() for p in (cal, bundle)} == before and not (tmp_path / "o.kvtc").exists()


@pytest.mark.parametrize("head", [b"", b"\x01", struct.pack("<Q", 1 << 62) + b"{}", struct.pack("<Q", 2) + b"[]",
                                  struct.pack("<Q", 40) + b'{"__metadata__": {"other": "x"}}' + b" " * 8,
                                  b"KVXBND", b"\xff" * 64])
def test_unknown_or_forged_heads_are_no_kind(tmp_path, head):
    """A huge declared header length reads at most the file; foreign bytes are no kind (the reader refuses them)."""
    p = tmp_path / "f"
    p.write_bytes(head)
    assert file_kind(str(p)) is None
    expect_kind(str(p), "bundle")  # passes on to the reader
    assert file_kind(str(tmp_path / "missing")) is None


def test_file_kind_reads_a_bounded_prefix(tmp_path, monkeypatch):
    """A safetensors header beyond MAX_SNIFF_BYTES is searched only up to it."""
    from kvx_cli import filekind

    monkeypatch.setattr(filekind, "MAX_SNIFF_BYTES", 64)
    p = tmp_path / "c.kvxcal"
    header = json.dumps({"__metadata__": {"pad": "x" * 100, "kvx_kv_calibration": "{}"}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    assert file_kind(str(p)) is None
    monkeypatch.setattr(filekind, "MAX_SNIFF_BYTES", 1 << 20)
    assert file_kind(str(p)) == "kv-calibration"


# ---------------------------------------------------------------- the sample metadata
def _forge_sample(path, value: str) -> None:
    """Rewrite a calibration file with `value` as its sample metadata (the identity, which does not cover it, kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safetensors)
    meta[SAMPLE_KEY] = value
    os.unlink(path)
    save_file(tensors, str(path), metadata=meta)


def test_sample_round_trips(tmp_path):
    p = tmp_path / "c.kvxcal"
    sample = {"tokens": 2048, "windows": 2, "window_len": 1024, "text": "pydoc_data.topics"}
    cal = _cal(sample)
    cal.save(str(p))
    back = load_kv_calibration(str(p))
    assert back.sample == sample and back.identity == cal.identity == _cal().identity  # not in the identity


@pytest.mark.parametrize("value", ['{"tokens": 1.5}', '{"tokens": true}', '{"tokens": 0}', '{"tokens": NaN}',
                                   '{"tokens": Infinity}', '{"windows": "2"}', '{"text": 3}', '{"rows": 2}',
                                   '[1, 2]', '"x"', '{"text": "' + "x" * 5000 + '"}', "[" * 100000, "{",
                                   '{"tokens": 1e400}'])
def test_a_forged_sample_is_refused(tmp_path, value):
    """The sample metadata is outside input like the rest: a non-integer, bool, NaN, unknown field, long text or
    deep nesting is INVALID_ARGUMENT (never truncated or ignored)."""
    p = tmp_path / "c.kvxcal"
    _cal().save(str(p))
    _forge_sample(p, value)
    with pytest.raises(KvxError) as e:
        load_kv_calibration(str(p))
    assert e.value.status == Status.INVALID_ARGUMENT


def test_sample_is_checked_on_construction():
    with pytest.raises(KvxError) as e:
        _cal({"tokens": 2.0})
    assert e.value.status == Status.INVALID_ARGUMENT


# ---------------------------------------------------------------- default file name
def test_default_file_prefers_the_new_name_and_still_finds_the_old(tmp_path):
    assert default_file(str(tmp_path)) is None and default_file(str(tmp_path / "none")) is None
    _cal().save(str(tmp_path / LEGACY_FILENAME))
    assert default_file(str(tmp_path)) == str(tmp_path / LEGACY_FILENAME)
    _cal().save(str(tmp_path / FILENAME))
    assert default_file(str(tmp_path)) == str(tmp_path / FILENAME)
    assert FILENAME.endswith(".kvxcal")


def test_tgi_finds_the_old_name(tmp_path, monkeypatch):
    """The TGI backend's lookup beside the weights reads a file written under the old name."""
    pytest.importorskip("kvx_tgi")
    from kvx_tgi import calibration

    monkeypatch.delenv(calibration.ENV, raising=False)
    (tmp_path / "model.safetensors").write_bytes(b"")
    _cal().save(str(tmp_path / LEGACY_FILENAME))

    weights = type("Weights", (), {})()
    weights.routing = {"w": str(tmp_path / "model.safetensors")}
    assert calibration._path(weights) == str(tmp_path / LEGACY_FILENAME)


# ---------------------------------------------------------------- progress
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_off_a_terminal_unless_asked():
    s = io.StringIO()
    p = Progress("work", 3, stream=s)
    for _ in range(3):
        p.step()
    assert s.getvalue() == ""
    t = _Tty()
    p = Progress("work", 3, stream=t, interval=1e9)
    for i in range(3):
        p.step(f"item {i}")
    lines = t.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("work: 1/3 (item 0)") and "left" in lines[0]  # first and last
    assert lines[1].startswith("work: 3/3 (item 2)")
    s = io.StringIO()
    p = Progress("work", 2, stream=s, enabled=True, interval=0)
    p.step()
    p.step()
    assert len(s.getvalue().splitlines()) == 2


# ---------------------------------------------------------------- fuzz
def fuzz_file_kind(rng) -> None:
    """A damaged calibration file or bundle: `file_kind` names a kind or None and never raises; `expect_kind`
    raises KvxError only (the runner allows nothing else)."""
    import tempfile

    from tests.fuzz import mutate_bytes

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        if rng.random() < 0.5:
            _cal().save(path)
        else:
            _bundle(path)
        with open(path, "rb") as f:
            data = mutate_bytes(f.read(), rng)
        with open(path, "wb") as f:
            f.write(data)
        assert file_kind(path) in (None, "bundle", "kvtc", "kv-calibration", "kvtc-calibration")
        expect_kind(path, rng.choice(["bundle", "kv-calibration", "kvtc"]))


def test_fuzz_file_kind():
    from tests.fuzz import run_capped

    run_capped("tests.test_output_files:fuzz_file_kind", cases=300)
