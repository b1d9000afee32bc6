"""`kvx calibrate-kv`: write a model's KV-cache calibration file (`kvx_core.kv_calibration`), which the vLLM plugin
and the TGI backend load from the checkpoint directory; `kvx calibrate-kv inspect FILE`: what such a file holds.

Defaults: the best recipe measured (`RECIPE`): key centering, key smoothing ALPHA 0.25 fitted on the centered keys,
MSE scales fitted on (K - c) / s, over `DEFAULT_TOKENS` tokens of text (`--tokens`, in windows of `--window-len`).
Source of the global scales: calibration text (rule "mse" or "amax"), or with `--source checkpoint` the
checkpoint's own `k_scale` / `v_scale` (rule "checkpoint"), which describe the keys as the model makes them, so
that source has no smoothing or centering (`--smooth-keys` / `--center-keys` with it are refused); `--source auto`
takes the checkpoint's scales only when both transforms are turned off (`--no-smooth-keys --no-center-keys`).
Every input and the output path are checked before the model loads (and before the demo checkpoint is built):
--text must be a regular file of at most `demo_cmd.MAX_TEXT_BYTES`, --out a regular file name in an existing
directory. The output is a new file (an existing regular file only with --force), written through a temporary file
and renamed into place. Progress (per window, then per format and layer, with the time left) goes to stderr when it
is a terminal, or with --progress.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch

from kvx_core.calibration import SCALE_RULES, SampleObserver, amax_from_checkpoint
from kvx_core.errors import KvxError, Status, require
from kvx_core.kv_calibration import (
    FILENAME,
    WEIGHT_SUFFIXES,
    KvCalibration,
    fingerprint_dict,
    from_checkpoint_amax,
    from_samples,
    global_formats,
    load_kv_calibration,
    scale_formats,
)
from kvx_demo.text import TEXT_NAME

from .args import bounded_int
from .demo_cmd import MAX_TEXT_BYTES, MAX_WINDOW_LEN, _alpha, _read_text
from .filekind import expect_kind
from .progress import Progress
from .recipe import DEFAULT_ALPHA, RECIPE, SCALE_RULE

SOURCES = ("auto", "checkpoint", "text")
_SCALE_KEY = re.compile(r"(?:^|\.)layers\.\d+\..*\b[kv]_scale$")
DEFAULT_TOKENS = 2048
DEFAULT_WINDOW_LEN = 1024
MAX_TOKENS = 1 << 16
"""--tokens' upper bound: the K/V of every calibration token are kept in FP32 (SmolLM2: 46 KB a token)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate-kv", help="write a model's KV-cache calibration (key centering and smoothing, "
                                            "global scales), or inspect one",
                       description="Fit per-layer K/V global scales (fp8_*, nvfp4, k8v4 and their _rot variants), "
                                   "key centering and key smoothing for a Hugging Face checkpoint, and write them as "
                                   f"<checkpoint>/{FILENAME} (or --out), the file the vLLM plugin and the TGI "
                                   f"backend load. Defaults: {RECIPE}. `kvx calibrate-kv inspect FILE` prints what "
                                   "a calibration file holds. Exit 2 with one line when an input is refused.")
    p.add_argument("action", nargs="?", choices=("inspect",), help="inspect FILE: print a calibration file's contents")
    p.add_argument("file", nargs="?", help="inspect: the calibration file")
    p.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: the demo's SmolLM2-135M "
                                              "checkpoint, built once as `kvx demo` does)")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="where the global scales come from: calibration text, or the checkpoint's k_scale / v_scale "
                        "(no centering or smoothing then); auto (default): text, unless --no-smooth-keys "
                        "--no-center-keys are given and the checkpoint has k_scale / v_scale")
    p.add_argument("--text", type=Path, help=f"calibration text, a UTF-8 file of at most {MAX_TEXT_BYTES >> 20} MiB "
                                             "(default: the demo's text, pydoc_data.topics)")
    p.add_argument("--tokens", type=bounded_int(2, MAX_TOKENS), default=DEFAULT_TOKENS,
                   help=f"calibration sample: tokens of text, --window-len or fewer (one window) or a multiple of it "
                        f"(default {DEFAULT_TOKENS}; the vectors of a 128-token sample made nvfp4 worse); the MSE fit "
                        "takes time in proportion")
    p.add_argument("--window-len", type=bounded_int(2, MAX_WINDOW_LEN), default=DEFAULT_WINDOW_LEN,
                   help=f"tokens per forward pass over the text (default {DEFAULT_WINDOW_LEN}; at most the model's "
                        "context)")
    p.add_argument("--rule", choices=SCALE_RULES, help="text source: how scales are fitted (default mse)")
    p.add_argument("--smooth-keys", nargs="?", const=DEFAULT_ALPHA, type=_alpha, default=None, metavar="ALPHA",
                   help="per-channel key smoothing, s = (channel amax / head geometric mean) ** ALPHA, fitted on "
                        f"the centered keys; the scales on the smoothed keys (default: on, ALPHA {DEFAULT_ALPHA})")
    p.add_argument("--no-smooth-keys", action="store_true", help="no key smoothing")
    p.add_argument("--center-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="per-channel key centering, c = each channel's mean key (the cache stores K - c, readers add "
                        "c back; attention is shift invariant, so not for models with a logit soft cap) (default: on)")
    p.add_argument("--formats", default=None,
                   help=f"comma-separated formats to fit scales for (default: every one with a global scale: "
                        f"{', '.join(global_formats())}; the checkpoint source: those without _rot)")
    p.add_argument("--out", type=Path, help=f"output file (default: <checkpoint>/{FILENAME})")
    p.add_argument("--force", action="store_true", help="replace an existing output file (default: refused)")
    p.add_argument("--progress", action="store_true",
                   help="print progress on stderr also when it is not a terminal (default: only on a terminal)")
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


def _windows(tokens: int, window_len: int) -> tuple[int, int]:
    """(windows, tokens per window) of a `tokens` sample: one window of `tokens` up to `window_len`, else whole
    windows of `window_len` (INVALID_ARGUMENT for a remainder, which would not be calibrated on)."""
    if tokens <= window_len:
        return 1, tokens
    require(tokens % window_len == 0, Status.INVALID_ARGUMENT,
            f"--tokens {tokens} is not a multiple of --window-len {window_len}; name whole windows")
    return tokens // window_len, window_len


def _transforms(a: argparse.Namespace) -> tuple[float | None, bool]:
    """(smoothing ALPHA or None, centering): the recipe's unless turned off; `--source checkpoint` turns both off
    and refuses them when named."""
    require(a.smooth_keys is None or not a.no_smooth_keys, Status.INVALID_ARGUMENT,
            "--smooth-keys and --no-smooth-keys contradict each other")
    named = [f for f, on in (("--smooth-keys", a.smooth_keys is not None), ("--center-keys", a.center_keys)) if on]
    if a.source == "checkpoint":
        require(not named, Status.INVALID_ARGUMENT,
                f"{' and '.join(named)}: fitted on the keys themselves, and then the scales too (the checkpoint's "
                "k_scale describes unsmoothed, uncentered keys); use --source text (or auto)")
        return None, False
    alpha = None if a.no_smooth_keys else (a.smooth_keys if a.smooth_keys is not None else DEFAULT_ALPHA)
    return alpha, a.center_keys is not False


def _from_text(source: Path, a: argparse.Namespace, text: str | None, windows: tuple[int, int], shape: dict,
               formats: list[str], model: dict, alpha: float | None, center: bool) -> KvCalibration:
    """Observe K/V on `windows` (count, length) of text (the demo's path, window by window), then fit centering,
    smoothing and scales, reporting progress (`progress.Progress`)."""
    from kvx_demo import load_model, load_windows

    from .demo_cmd import observe_kv

    lm = load_model(source)
    count, length = windows
    ids = load_windows(lm.tokenizer, count, length, text)
    obs = SampleObserver(shape["num_layers"], max_tokens=a.tokens)
    enabled = True if a.progress else None
    seen = Progress("calibrate-kv: observing K/V, window", count, enabled=enabled)
    for w in range(count):
        observe_kv(lm.model, ids[w:w + 1], shape, block_size=16, obs=obs)
        seen.step()
    fit = Progress("calibrate-kv: fitting scales, format x layer", len(formats) * shape["num_layers"], enabled=enabled)
    sample = {"tokens": a.tokens, "windows": count, "window_len": length,
              "text": str(a.text) if a.text is not None else TEXT_NAME}
    return from_samples(obs, formats, rule=a.rule or SCALE_RULE, alpha=alpha, model=model, center=center, sample=sample,
                        progress=fit.step)


def _check_out(out: Path, model_dir: Path, force: bool, folder_built_later: bool) -> None:
    """The output path, checked before the model loads (and before the demo checkpoint is built): no weight file name
    inside the model directory, an existing folder this user can write in (unless it is the demo checkpoint, which
    `folder_built_later`), and an existing path only with --force, and only a regular file (never a directory,
    device or FIFO)."""
    require(not (out.resolve().parent == model_dir.resolve() and out.name.endswith(WEIGHT_SUFFIXES)),
            Status.INVALID_ARGUMENT,
            f"--out {out}: engines load every {'/'.join(WEIGHT_SUFFIXES)} file of a checkpoint directory as weights; "
            f"name it differently (default {FILENAME})")
    folder = out.resolve().parent
    require(folder_built_later or (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)), Status.INVALID_ARGUMENT,
            f"--out {out}: {folder} is not a directory this user can write in")
    if os.path.lexists(out):
        require(force, Status.INVALID_ARGUMENT,
                f"{out} exists; pass --force to replace it (KVX never overwrites a file otherwise)")
        require(out.is_file(), Status.INVALID_ARGUMENT,
                f"--out {out} is not a regular file (a directory, device or FIFO): --force replaces files only")


def _inspect(a: argparse.Namespace) -> int:
    """One screen on a calibration file: geometry, model, what it holds and what it was fitted on."""
    require(a.file is not None, Status.INVALID_ARGUMENT, "inspect needs FILE: kvx calibrate-kv inspect FILE")
    given = [flag for flag, on in (
        ("--model", a.model is not None), ("--source", a.source != "auto"), ("--text", a.text is not None),
        ("--tokens", a.tokens != DEFAULT_TOKENS), ("--window-len", a.window_len != DEFAULT_WINDOW_LEN),
        ("--rule", a.rule is not None), ("--smooth-keys", a.smooth_keys is not None),
        ("--no-smooth-keys", a.no_smooth_keys), ("--center-keys", a.center_keys is not None),
        ("--formats", a.formats is not None), ("--out", a.out is not None), ("--force", a.force),
        ("--progress", a.progress)) if on]
    require(not given, Status.INVALID_ARGUMENT, f"inspect reads FILE only; {', '.join(given)} apply to calibrating")
    require(os.path.isfile(a.file), Status.INVALID_ARGUMENT, f"{a.file}: no such file")
    expect_kind(a.file, "kv-calibration")
    cal = load_kv_calibration(a.file)
    m, p = cal.model, cal.params()

    def span(ts) -> str:
        t = torch.cat([x.reshape(-1) for x in ts if x is not None])
        return f"{float(t.min()):.4g} .. {float(t.max()):.4g}"

    sample = cal.sample or {}
    rows = [("calibration", f"version {p['version']}, identity {cal.identity[:16]}..."),
            ("model", f"{m['architecture']}, config / tokenizer sha256 {str(m['config_sha256'])[:16]}... / "
                      f"{str(m['tokenizer_sha256'])[:16]}..." if m else "not recorded (applies to any model of this "
                                                                       "geometry)"),
            ("geometry", f"{cal.num_layers} layers x {cal.num_kv_heads} KV heads x head_dim {cal.head_dim}"),
            ("key centering", f"yes, c in {span(cal.center)}" if cal.center is not None else "no"),
            ("key smoothing", f"ALPHA {cal.alpha}, s in {span(cal.smoothing)}" if cal.smoothing is not None else "no"),
            ("scale rule", cal.rule or "no scales"),
            ("sample", f"{sample['tokens']} tokens ({sample.get('windows', '?')} x {sample.get('window_len', '?')}) "
                       f"of {sample.get('text', '?')}" if "tokens" in sample else "not recorded")]
    for name, layers in sorted(cal.scales.items()):
        sides = [f"{side} {span(g for pair in layers for g in pair[i:i + 1])}" for i, side in enumerate("KV")
                 if layers[0][i] is not None]
        width = next(g for g in layers[0] if g is not None).numel()
        rows.append((f"scales {name}", f"{'; '.join(sides)} ({'per KV head' if width > 1 else 'per layer'})"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def run(a: argparse.Namespace) -> int:
    """Check every argument and path (the output's too) before the model loads, pick the source, fit, write."""
    if a.action == "inspect":
        return _inspect(a)
    text = _read_text(a.text)
    if a.formats is not None:
        scale_formats(_formats(a.formats, a.source))  # before the model loads
    require(a.model is None or a.model.is_dir(), Status.INVALID_ARGUMENT, f"--model {a.model}: not a directory")
    alpha, center = _transforms(a)
    require(a.source != "checkpoint" or (a.text is None and a.rule is None), Status.INVALID_ARGUMENT,
            "--text and --rule apply to calibration on text, not --source checkpoint")
    count, length = _windows(a.tokens, a.window_len)
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
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap and center:  # engines refuse centered keys for it: the default turns centering off
        require(a.center_keys is None, Status.INVALID_ARGUMENT,
                f"--center-keys: {source} caps its attention logits (soft cap {softcap}) and tanh is not shift "
                "invariant, so engines refuse centered keys for it; pass --no-center-keys")
        center = False
    transform = alpha is not None or center
    shape = model_shape(config)
    from kvx_core.transfer import checkpoint_fingerprint

    model = fingerprint_dict(checkpoint_fingerprint(str(source)))
    amax = None if a.source == "text" or transform else _checkpoint_amax(Path(source), shape["num_layers"])
    require(a.source != "checkpoint" or amax is not None, Status.INVALID_ARGUMENT,
            f"{source} has no k_scale / v_scale tensors; use --source text")
    use_ckpt = amax is not None and not transform
    require(not use_ckpt or (a.text is None and a.rule is None), Status.INVALID_ARGUMENT,
            f"{source} has k_scale / v_scale, which --source auto uses without key transforms: --text / --rule would "
            "be unused; pass --source text to calibrate on text")
    formats = _formats(a.formats, "checkpoint" if use_ckpt else "text")
    context = getattr(config, "max_position_embeddings", None)
    require(use_ckpt or context is None or length <= context, Status.OUT_OF_RANGE,
            f"a window of {length} tokens (--tokens / --window-len) exceeds the model's context of {context} tokens")
    start = time.perf_counter()
    if use_ckpt:
        cal = from_checkpoint_amax(amax, formats, num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                                   model=model)
    else:
        cal = _from_text(Path(source), a, text, (count, length), shape, formats, model, alpha, center)
    ident = cal.save(out, overwrite=a.force)
    what = ", ".join(filter(None, ["key centering" if cal.center is not None else None,
                                   f"key smoothing alpha {cal.alpha}" if cal.alpha else None,
                                   f"{cal.rule} scales for {', '.join(sorted(cal.scales))}"]))
    print(f"{out}: KV calibration {ident[:16]}... ({cal.num_layers} layers: {what}; "
          f"{'checkpoint k_scale / v_scale' if use_ckpt else f'{a.tokens} tokens of text, {count} x {length}'}, "
          f"{time.perf_counter() - start:.1f} s)")
    return 0
