"""Plot KVTC's ratio / accuracy curve from `bench_kvtc.py` JSON lines: perplexity delta and top-1 agreement vs the
coded ratio, per text, for the default configuration (groups of 6 layers, ranges of 16, RoPE removed, separate K / V
budgets) and the best one measured (30 layers in one group, ranges of 32, joint budget).

Usage: python benchmarks/plot_kvtc.py RESULTS.jsonl OUT.png (e.g. benchmarks/results/kvtc_smollm2_cpu.jsonl
benchmarks/results/kvtc_curve_smollm2_cpu.png; needs matplotlib, which the benchmarks do not otherwise use:
pip install matplotlib)
"""
from __future__ import annotations

import json
import sys


def series(rows: list[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """(label) -> sorted [(coded ratio, ppl delta %, top-1 %)] per text, DEFLATE rows left out (same accuracy)."""
    out: dict[str, list] = {}
    for r in rows:
        if r.get("deflate") or not r.get("rope_removed", True):
            continue
        cfg = "default" if (r["layers_per_group"], r["range_size"], r.get("joint", False)) == (6, 16, False) else \
            "30 layers, joint" if (r["layers_per_group"], r.get("joint", False)) == (30, True) else None
        if cfg is None:
            continue
        for text in ("demo_text", "second_text"):
            t = r[text]
            out.setdefault(f"{cfg}, {text.replace('_', ' ')}", []).append(
                (t["coded_ratio_vs_bf16"], t["ppl_delta_pct"], 100 * t["top1_agreement"]))
    return {k: sorted(v) for k, v in out.items()}


def main(src: str, dst: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(src)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label, pts in series(rows).items():
        style = "-o" if label.startswith("default") else "--s"
        a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        b.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
    a.axhline(1.0, color="grey", lw=0.8, ls=":")
    a.axvline(16.0, color="grey", lw=0.8, ls=":")
    a.set(xscale="log", xlabel="coded ratio vs BF16", ylabel="perplexity delta (%)",
          title="KVTC on SmolLM2-135M (target: 16x at +1%)")
    b.set(xscale="log", xlabel="coded ratio vs BF16", ylabel="top-1 agreement (%)", title="next-token agreement")
    for ax in (a, b):
        ax.set_xticks([8, 12, 16, 32], ["8", "12", "16", "32"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
