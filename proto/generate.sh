#!/usr/bin/env bash
# Regenerates the Python stubs beside the .proto files: proto/specd/v1/*_pb2*.py from proto/specd/v1/*.proto.
# Usage: proto/generate.sh [OUT_DIR]   (default: proto/; tests pass a temp dir
# and compare, so the committed stubs can never drift from the .proto files).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/proto}
python=${PYTHON:-$root/.venv/bin/python}
"$python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root"/proto/specd/v1/*.proto
