#!/usr/bin/env bash
# Regenerates what the .proto files make: the Python stubs beside them (proto/specd/v1/*_pb2*.py from
# proto/specd/v1/*.proto) and the gRPC API reference page, docs/reference/grpc.md (scripts/grpc_reference.py).
# Usage: proto/generate.sh [OUT_DIR]   (default: proto/ and docs/reference/; given OUT_DIR, the stubs go
# to OUT_DIR/specd/v1/ and the page to OUT_DIR/grpc.md: tests pass a temp dir and compare, so neither
# the committed stubs nor the committed page can drift from the .proto files).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/proto}
page=$root/docs/reference/grpc.md
[ $# -ge 1 ] && page=$out/grpc.md
python=${PYTHON:-$root/.venv/bin/python}
"$python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root"/proto/specd/v1/*.proto
"$python" "$root/scripts/grpc_reference.py" "$page"
