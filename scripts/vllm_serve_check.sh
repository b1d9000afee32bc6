#!/usr/bin/env bash
# `vllm serve MODEL --kv-cache-dtype DTYPE` with vLLM's defaults (torch.compile, CUDA graphs), one completion, clean
# stop; prints the KVX / KV-cache / graph lines of the server log. Usage: scripts/vllm_serve_check.sh MODEL [DTYPE] [LOG]
# (vLLM 0.26 on a GPU machine: the API server also needs uvicorn, watchfiles, uvloop, httptools and
# prometheus-fastapi-instrumentator, which ../shared/gpu's offline wheel set does not include.)
set -u
model=$1; dtype=${2:-kvx_nvfp4}; log=${3:-serve_$dtype.log}; port=${PORT:-8011}
python3 -m vllm.entrypoints.cli.main serve "$model" --kv-cache-dtype "$dtype" --max-model-len 4096 \
  --gpu-memory-utilization 0.3 --host 127.0.0.1 --port "$port" > "$log" 2>&1 &
pid=$!
for _ in $(seq 1 150); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 $pid 2>/dev/null || { echo "vllm serve exited:"; tail -20 "$log"; exit 2; }
  sleep 2
done
curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
echo
kill -INT $pid 2>/dev/null; wait $pid; rc=$?
grep -E "KVX|GPU KV cache size|Graph capturing finished" "$log"
exit $rc
