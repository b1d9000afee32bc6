"""Accuracy of an MXFP4 lm_head on SmolLM2-135M (CPU): KL, top-1 agreement and perplexity vs the BF16 head, on the
demo text and a held-out text (`kvx_demo.lm_head_eval`).

Usage: python benchmarks/bench_lm_head_accuracy.py [--windows 4] [--window-len 1024] [--out FILE.jsonl]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, env_info  # noqa: E402

from kvx_demo.kvtc_eval import second_text  # noqa: E402
from kvx_demo.lm_head_eval import lm_head_accuracy  # noqa: E402
from kvx_demo.model import load_model  # noqa: E402
from kvx_demo.text import load_windows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/lm_head_mxfp4_accuracy.jsonl")
    a = ap.parse_args()
    loaded = load_model()
    for name, text in (("demo", None), ("held_out", second_text())):
        windows = load_windows(loaded.tokenizer, a.windows, a.window_len, text=text)
        rec = {"bench": "lm_head_accuracy", **env_info(), "model": "SmolLM2-135M", "text": name,
               "windows": a.windows, "window_len": a.window_len, **lm_head_accuracy(loaded.model, windows)}
        emit(a.out, rec)
        print(rec)


if __name__ == "__main__":
    main()
