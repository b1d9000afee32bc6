"""The calibration recipe KVX measured best, shared by `kvx calibrate-kv` (its defaults) and `kvx demo --recipe`."""
from __future__ import annotations

DEFAULT_ALPHA = 0.25
"""Key smoothing strength of the recipe (s = (channel amax / head geometric mean) ** ALPHA, fitted on centered keys)."""
SCALE_RULE = "mse"
"""Global scales of the recipe: the scale with the least encode -> decode error."""
RECIPE = ("key centering + key smoothing ALPHA 0.25 + MSE scales: the best measured for fp8_e4m3, k8v4, int8, "
          "nvfp4_rot, int4_rot (benchmarks/results/demo_key_centering_smollm2_cpu.jsonl, docs/results.md "
          "\"Calibration\")")
