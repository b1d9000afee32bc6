#!/usr/bin/env bash
# On the GPU machine: stage one carried folder of scripts/gpu_carry.sh; the last one installs / assembles.
#   bash scripts/gpu_stage.sh vllm N     # .cache/vllm026/cN; at the last folder vLLM 0.26 + kvx_vllm go to /tmp/site
#   bash scripts/gpu_stage.sh ckpt XX    # .cache/smollm2_bf16/c_XX; at the last part /tmp/kvxc/smollm2-135m
#   bash scripts/gpu_stage.sh nixl       # .cache/nixl_cu13_py312 into /tmp/site
# Then: export PYTHONPATH=/tmp/site:$PWD KVX_CACHE_DIR=/tmp/kvxc (vLLM's workers need the PYTHONPATH too).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  vllm)
    mkdir -p /tmp/vw && cp -r ".cache/vllm026/c$2/." /tmp/vw/
    # the last folder carries the installer and the count of the wheel's parts: install once every part is there
    # (a machine given back between calls loses the earlier folders; the installer concatenates the parts once)
    if [ -f /tmp/vw/vllm.parts ] && [ "$(ls /tmp/vw/vllm-*.whl.part-* | wc -l)" -eq "$(cat /tmp/vw/vllm.parts)" ]; then
      (cd /tmp/vw && bash install_on_gpu.sh /tmp/site)
      PYTHONPATH=/tmp/site:$PWD python3 -c "import vllm, kvx_vllm, flashinfer; print('vllm', vllm.__version__, 'flashinfer', flashinfer.__version__)"
    fi ;;
  ckpt)
    mkdir -p /tmp/ck && cp ".cache/smollm2_bf16/c_$2/"* /tmp/ck/
    # every part there (c_aa carries their count): assemble, check, unpack
    if [ -f /tmp/ck/ck.parts ] && [ "$(ls /tmp/ck/ck.tar.part-* | wc -l)" -eq "$(cat /tmp/ck/ck.parts)" ]; then
      (cd /tmp/ck && cat ck.tar.part-* > ck.tar && sha256sum -c ck.sha && mkdir -p /tmp/kvxc \
         && tar xf ck.tar -C /tmp/kvxc && rm -f ck.tar.part-* ck.tar)
      ls /tmp/kvxc/smollm2-135m
    fi ;;
  nixl)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/nixl_cu13_py312/*.whl
    PYTHONPATH=/tmp/site python3 -c "import nixl; print('nixl', nixl.__file__)" ;;
  *) echo "usage: gpu_stage.sh vllm N | ckpt XX | nixl" >&2; exit 2 ;;
esac
