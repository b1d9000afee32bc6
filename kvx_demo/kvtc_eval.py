"""KVTC on the demo model: collect K/V for calibration, and measure what compressing a prompt's KV costs.

`collect_kv` runs the model over windows of text and returns each window's K/V per layer as BF16 `[T, H, D]` (what
an engine's BF16 cache holds: post-RoPE keys). `evaluate_kvtc` splits each window into a prefix and a continuation:
the prefix's K/V is computed once, stored as BF16 (the baseline) or passed through KVTC (compress, decompress), and
the continuation is scored teacher-forced over that prefix cache. Reported: perplexity of the continuation with
either prefix, the KVTC delta, top-1 agreement of the continuation's predictions, the compression ratio vs the BF16
prefix (the whole buffer, raw sink / recent tokens included; and of the coded tokens alone, before DEFLATE: what a
long context approaches), and compress / decompress throughput.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvx_core.errors import Status, require
from kvx_core.kvtc import Calibration, compress, decompress, read_header

SECOND_TEXT_MODULES = ("argparse", "collections", "csv", "difflib", "email.message", "json", "logging", "re",
                       "string", "textwrap", "typing", "unittest", "urllib.parse", "zipfile")


def second_text() -> str:
    """A held-out text: the docstrings of a fixed list of stdlib modules and their public members, in name order
    (deterministic for a CPython version; different prose from the demo's pydoc topics)."""
    import importlib
    import inspect

    parts = []
    for name in SECOND_TEXT_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", None) or [a for a in dir(mod) if not a.startswith("_")]):
            doc = inspect.getdoc(getattr(mod, attr, None))
            if doc and len(doc) > 80:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def _cache_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A transformers cache's per-layer K/V of batch row 0 as BF16 `[T, H, D]`."""
    return [(layer.keys[0].transpose(0, 1).to(torch.bfloat16), layer.values[0].transpose(0, 1).to(torch.bfloat16))
            for layer in cache.layers]


def collect_kv(model: Any, windows: torch.Tensor, progress: Callable[[], None] | None = None
               ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`windows [N, T]` token ids -> per window, per layer, BF16 (K, V) `[T, H, D]`; `progress()` after each window."""
    from transformers import DynamicCache

    out = []
    with torch.inference_mode():
        for ids in windows:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[None], past_key_values=cache, use_cache=True)
            out.append(_cache_kv(cache))
            if progress is not None:
                progress()
    return out


def _score(model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]],
           cont: torch.Tensor) -> tuple[float, torch.Tensor, int]:
    """Teacher-forced NLL sum of `cont[1:]` over a prefix cache holding `kv`, the argmax predictions, the count."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    dt = next(model.parameters()).dtype
    for i, (k, v) in enumerate(kv):
        cache.update(k.transpose(0, 1)[None].to(dt), v.transpose(0, 1)[None].to(dt), i)
    logits = model(input_ids=cont[None], past_key_values=cache, use_cache=True).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, cont[1:, None]).sum()
    return float(nll), logits.argmax(-1), cont.numel() - 1


def evaluate_kvtc(model: Any, windows: torch.Tensor, cal: Calibration, *, prefix: int, deflate: bool = False,
                  model_fp: Any = None) -> dict:
    """Score each window's continuation (tokens after `prefix`) over a BF16 prefix cache and over a KVTC one."""
    require(0 < prefix < windows.shape[1] - 1, Status.INVALID_ARGUMENT,
            f"prefix {prefix} must leave a continuation of >= 2 tokens in windows of {windows.shape[1]}")
    nll_ref = nll_kvtc = 0.0
    agree = count = raw_bytes = kvtc_bytes = coded_in = coded_out = 0
    t_c = t_d = 0.0
    with torch.inference_mode():
        for ids in windows:
            kv = collect_kv(model, ids[None, :prefix])[0]
            cont = ids[prefix - 1:]  # the last prefix token's next-token logit is the first scored one
            t0 = time.perf_counter()
            buf = compress(kv, cal, model=model_fp, deflate=deflate)
            t1 = time.perf_counter()
            _, back, _ = decompress(buf, cal, model=model_fp)
            t2 = time.perf_counter()
            t_c, t_d = t_c + t1 - t0, t_d + t2 - t1
            raw_bytes += sum(k.numel() * 2 + v.numel() * 2 for k, v in kv)
            kvtc_bytes += len(buf)
            hdr = read_header(buf)
            per_token = sum(k[0].numel() + v[0].numel() for k, v in kv) * 2  # BF16 bytes of one token, all layers
            kept = hdr.raw_head + hdr.raw_tail  # stored raw: their bytes are not coded
            coded_in += (prefix - kept) * per_token
            coded_out += hdr.raw_body_bytes - kept * per_token
            a, pa, n = _score(model, [(k[:-1], v[:-1]) for k, v in kv], cont)
            b, pb, _ = _score(model, [(k[:-1], v[:-1]) for k, v in back], cont)
            nll_ref, nll_kvtc = nll_ref + a, nll_kvtc + b
            agree += int((pa == pb).sum())
            count += n
    ppl_ref = float(torch.tensor(nll_ref / count).exp())
    ppl_kvtc = float(torch.tensor(nll_kvtc / count).exp())
    return {"ppl_bf16": ppl_ref, "ppl_kvtc": ppl_kvtc, "ppl_delta_pct": 100 * (ppl_kvtc / ppl_ref - 1),
            "top1_agreement": agree / count, "ratio_vs_bf16": raw_bytes / kvtc_bytes,
            "coded_ratio_vs_bf16": coded_in / max(coded_out, 1), "scored_tokens": count,
            "compress_gbps": raw_bytes / t_c / 1e9, "decompress_gbps": raw_bytes / t_d / 1e9}
