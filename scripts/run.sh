#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, fetch and verify the default model pair (a
# no-op once cached), then run the whole stack here and generate a real completion, showing
# what speculation gained over the target alone. Extra arguments go to `specd generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/specd models fetch
if [ "$#" -eq 0 ]; then
  set -- "def quicksort(arr):" --max-new-tokens 64
fi
.venv/bin/specd generate "$@"
