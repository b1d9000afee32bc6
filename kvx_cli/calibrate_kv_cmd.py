"""`kvx calibrate-kv`: write a model's KV-cache calibration file (`kvx_core.kv_calibration`), which the vLLM plugin
and the TGI backend load from the checkpoint directory.

Source of the global scales: the checkpoint's own `k_scale` / `v_scale` where it has them (rule "checkpoint"),
else K/V observed on calibration text through an FP32 KVX cache, as `kvx demo --calibrate` does (rule "mse" or
"amax"). Key smoothing (`--smooth-keys`) and centering (`--center-keys`) always come from text: they need the keys
themselves, and then the scales do too (a checkpoint's k_scale describes the keys as the model makes them, not as
the cache stores them), so `--source checkpoint` with either is refused. With both, smoothing is fitted on the
centered keys, as `kvx demo --smooth-keys --center-keys` does.
Every input and the output path are checked before the model loads (and before the demo checkpoint is built):
--text must be a regular file of at most `demo_cmd.MAX_TEXT_BYTES`, --out a regular file name in an existing
directory. The output is a new file (an existing regular file only with --force), written through a temporary file
and renamed into place.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch

from kvx_core.calibration import SCALE_RULES, amax_from_checkpoint
from kvx_core.errors import KvxError, Status, require
from kvx_core.kv_calibration import (FILENAME, WEIGHT_SUFFIXES, KvCalibration, fingerprint_dict, from_checkpoint_amax,
                                     from_samples, global_formats, scale_formats)

from .args import bounded_int
from .demo_cmd import MAX_TEXT_BYTES, MAX_WINDOW_LEN, _alpha, _read_text

SOURCES = ("auto", "checkpoint", "text")
_SCALE_KEY = re.compile(r"(?:^|\.)layers\.\d+\..*\b[kv]_scale$")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate-kv", help="write a model's KV-cache calibration (key smoothing and centering, "
                                            "global scales)",
                       description="Fit per-layer K/V global scales (fp8_*, nvfp4, k8v4 and their _rot variants) "
                                   "and optionally key smoothing and centering for a Hugging Face checkpoint, and "
                                   "write them as "
                                   f"<checkpoint>/{FILENAME} (or --out), the file the vLLM plugin and the TGI "
                                   "backend load. Exit 2 with one line when an input is refused.")
    p.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: the demo's SmolLM2-135M "
                                              "checkpoint, built once as `kvx demo` does)")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="where the global scales come from: the checkpoint's k_scale / v_scale, or calibration text; "
                        "auto (default): the checkpoint where it has them (and no --smooth-keys / --center-keys), "
                        "else text")
    p.add_argument("--text", type=Path, help=f"calibration text, a UTF-8 file of at most {MAX_TEXT_BYTES >> 20} MiB "
                                             "(default: the demo's text, pydoc_data.topics)")
    p.add_argument("--window-len", type=bounded_int(2, MAX_WINDOW_LEN), default=1024,
                   help="tokens of calibration text, one window (default 1024; at most the model's context)")
    p.add_argument("--rule", choices=SCALE_RULES, help="text source: how scales are fitted (default mse)")
    p.add_argument("--smooth-keys", nargs="?", const=0.5, type=_alpha, default=None, metavar="ALPHA",
                   help="also fit per-channel key smoothing, s = (channel amax / head geometric mean) ** ALPHA "
                        "(default ALPHA 0.5); the scales are then fitted on the smoothed keys")
    p.add_argument("--center-keys", action="store_true",
                   help="also fit per-channel key centering, c = each channel's mean key (the cache stores K - c, "
                        "readers add c back; attention is shift invariant, so not for models with a logit soft "
                        "cap); with --smooth-keys, s is fitted on the centered keys; the scales on (K - c) / s")
    p.add_argument("--formats", default=None,
                   help=f"comma-separated formats to fit scales for (default: every one with a global scale: "
                        f"{', '.join(global_formats())}; the checkpoint source: those without _rot)")
    p.add_argument("--out", type=Path, help=f"output file (default: <checkpoint>/{FILENAME})")
    p.add_argument("--force", action="store_true", help="replace an existing output file (default: refused)")
    p.set_defaults(run=run)


def _formats(spec: str | None, source: str) -> list[str]:
    """The named formats (each once), or the default for `source`."""
    if spec is None:
        names = global_formats()
        return [n for n in names if not n.endswith("_rot")] if source == "checkpoint" else names
    names = [n.strip() for n in spec.split(",") if n.strip()]
    require(bool(names) and len(set(names)) == len(names), Status.INVALID_ARGUMENT,
            f"--formats {spec!r} must name formats, each once")
    return names


def _checkpoint_amax(model_dir: Path, num_layers: int) -> torch.Tensor | None:
    """The checkpoint's k_scale / v_scale as per-layer amax (`amax_from_checkpoint`), read from its safetensors
    files without loading the weights; None when it has none."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            found.update({k: st.get_tensor(k) for k in st.keys() if _SCALE_KEY.search(k)})
    return amax_from_checkpoint(found, num_layers)


def _from_text(source: Path, a: argparse.Namespace, text: str | None, shape: dict, formats: list[str],
               model: dict) -> KvCalibration:
    """Observe K/V on one window of text (the demo's path), then fit centering, smoothing and scales."""
    from kvx_demo import load_model, load_windows

    from .demo_cmd import observe_kv

    lm = load_model(source)
    ids = load_windows(lm.tokenizer, 1, a.window_len, text)
    obs = observe_kv(lm.model, ids, shape, block_size=16)
    return from_samples(obs, formats, rule=a.rule or "mse", alpha=a.smooth_keys, model=model, center=a.center_keys)


def _check_out(out: Path, model_dir: Path, force: bool, folder_built_later: bool) -> None:
    """The output path, checked before the model loads (and before the demo checkpoint is built): no weight file name
    inside the model directory, an existing folder this user can write in (unless it is the demo checkpoint, which
    `folder_built_later`), and an existing path only with --force, and only a regular file (never a directory,
    device or FIFO)."""
    require(not (out.resolve().parent == model_dir.resolve() and out.name.endswith(WEIGHT_SUFFIXES)),
            Status.INVALID_ARGUMENT, f"--out {out}: engines load every {'/'.join(WEIGHT_SUFFIXES)} file of a checkpoint "
            f"directory as weights; name it differently (default {FILENAME})")
    folder = out.resolve().parent
    require(folder_built_later or (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)), Status.INVALID_ARGUMENT,
            f"--out {out}: {folder} is not a directory this user can write in")
    if os.path.lexists(out):
        require(force, Status.INVALID_ARGUMENT,
                f"{out} exists; pass --force to replace it (KVX never overwrites a file otherwise)")
        require(out.is_file(), Status.INVALID_ARGUMENT,
                f"--out {out} is not a regular file (a directory, device or FIFO): --force replaces files only")


def run(a: argparse.Namespace) -> int:
    """Check every argument and path (the output's too) before the model loads, pick the source, fit, write."""
    text = _read_text(a.text)
    if a.formats is not None:
        scale_formats(_formats(a.formats, a.source))  # before the model loads
    require(a.model is None or a.model.is_dir(), Status.INVALID_ARGUMENT, f"--model {a.model}: not a directory")
    transform = [f for f, on in (("--smooth-keys", a.smooth_keys is not None), ("--center-keys", a.center_keys)) if on]
    require(a.source != "checkpoint" or not transform, Status.INVALID_ARGUMENT,
            f"{' and '.join(transform)}: fitted on the keys themselves, and then the scales too (the checkpoint's "
            "k_scale describes unsmoothed, uncentered keys); use --source text (or auto)")
    require(a.source != "checkpoint" or (a.text is None and a.rule is None), Status.INVALID_ARGUMENT,
            "--text and --rule apply to calibration on text, not --source checkpoint")
    try:
        from kvx_demo import default_checkpoint_dir, ensure_local_checkpoint, model_shape, read_checkpoint_config

        model_dir = a.model if a.model is not None else default_checkpoint_dir()
        out = a.out if a.out is not None else model_dir / FILENAME
        _check_out(out, model_dir, a.force, folder_built_later=a.out is None and a.model is None)
        source = a.model if a.model is not None else ensure_local_checkpoint()
        config = read_checkpoint_config(source)
    except ImportError as e:  # the demo's optional dependencies
        raise KvxError(Status.UNSUPPORTED, str(e)) from None
    out = str(out)
    shape = model_shape(config)
    from kvx_core.transfer import checkpoint_fingerprint

    model = fingerprint_dict(checkpoint_fingerprint(str(source)))
    amax = None if a.source == "text" else _checkpoint_amax(Path(source), shape["num_layers"])
    require(a.source != "checkpoint" or amax is not None, Status.INVALID_ARGUMENT,
            f"{source} has no k_scale / v_scale tensors; use --source text")
    use_ckpt = amax is not None and not transform
    require(not use_ckpt or (a.text is None and a.rule is None), Status.INVALID_ARGUMENT,
            f"{source} has k_scale / v_scale, which --source auto uses: --text / --rule would be unused; pass "
            "--source text to calibrate on text")
    formats = _formats(a.formats, "checkpoint" if use_ckpt else "text")
    context = getattr(config, "max_position_embeddings", None)
    require(use_ckpt or context is None or a.window_len <= context, Status.OUT_OF_RANGE,
            f"--window-len {a.window_len} exceeds the model's context of {context} tokens")
    start = time.perf_counter()
    if use_ckpt:
        cal = from_checkpoint_amax(amax, formats, num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                                   model=model)
    else:
        cal = _from_text(Path(source), a, text, shape, formats, model)
    ident = cal.save(out, overwrite=a.force)
    what = ", ".join(filter(None, ["key centering" if cal.center is not None else None,
                                   f"key smoothing alpha {cal.alpha}" if cal.alpha else None,
                                   f"{cal.rule} scales for {', '.join(sorted(cal.scales))}"]))
    print(f"{out}: KV calibration {ident[:16]}... ({cal.num_layers} layers: {what}; "
          f"{'checkpoint k_scale / v_scale' if use_ckpt else f'{a.window_len} tokens of text'}, "
          f"{time.perf_counter() - start:.1f} s)")
    return 0
