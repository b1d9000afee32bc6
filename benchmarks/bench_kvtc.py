"""KVTC on SmolLM2-135M (the demo model, CPU): compression ratio vs perplexity / top-1 agreement, calibration time,
codec throughput.

Calibration: the first `--cal-windows` windows of the demo text. Evaluation (held out): the next `--eval-windows`
windows of the demo text and as many of a second text (`kvx_demo.kvtc_eval.second_text`); each window's first
`--prefix` tokens are the prompt whose KV is compressed, the rest is scored teacher-forced over it
(`kvx_demo.kvtc_eval.evaluate_kvtc`). One JSON line per (ratio, deflate) to stdout and `--out`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, env_info  # noqa: E402

from kvx_core.kvtc import calibrate  # noqa: E402
from kvx_core.kvtc.rope import rope_theta_of  # noqa: E402
from kvx_demo.kvtc_eval import collect_kv, evaluate_kvtc, second_text  # noqa: E402
from kvx_demo.model import load_model  # noqa: E402
from kvx_demo.text import load_windows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratios", default="8,16,32", help="target ratios of the coded tokens vs BF16")
    ap.add_argument("--cal-windows", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--layers-per-group", type=int, default=6)
    ap.add_argument("--range-size", type=int, default=16)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--joint", action="store_true", help="K and V of a group share one byte budget")
    ap.add_argument("--no-rope-removal", action="store_true", help="code keys with their RoPE (as stored)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    env = env_info()
    lm = load_model()
    theta = None if a.no_rope_removal else rope_theta_of(lm.config)
    w = load_windows(lm.tokenizer, a.cal_windows + a.eval_windows, a.window_len)
    w2 = load_windows(lm.tokenizer, a.eval_windows, a.window_len, text=second_text())
    t0 = time.perf_counter()
    kv = collect_kv(lm.model, w[:a.cal_windows])
    collect_s = time.perf_counter() - t0
    for ratio in (float(r) for r in a.ratios.split(",")):
        t0 = time.perf_counter()
        cal = calibrate(kv, layers_per_group=a.layers_per_group, ratio=ratio, range_size=a.range_size,
                        sink_tokens=a.sink, recent_tokens=a.recent, rope_theta=theta, joint=a.joint)
        cal_s = time.perf_counter() - t0
        for deflate in (False, True):
            row = {**env, "bench": "kvtc", "model": "SmolLM2-135M", "device": "cpu", "target_ratio": ratio,
                   "deflate": deflate, "layers_per_group": a.layers_per_group, "range_size": a.range_size,
                   "sink": a.sink, "recent": a.recent, "rope_removed": theta is not None, "joint": a.joint,
                   "prefix": a.prefix, "window_len": a.window_len,
                   "calibration_s": round(collect_s + cal_s, 1),
                   "calibration_tokens": a.cal_windows * a.window_len}
            for name, windows in (("demo_text", w[a.cal_windows:]), ("second_text", w2)):
                r = evaluate_kvtc(lm.model, windows, cal, prefix=a.prefix, deflate=deflate)
                row[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
            emit(a.out, row)


if __name__ == "__main__":
    main()
