#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs every specd component with the test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $python"
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Every component folder is a distribution of its own (PEP 420 parts of the `specd` namespace);
# one pip command installs them all, editable, with the workspace's test tools. torch is pinned
# exactly in model/pyproject.toml: the local CPU wheel, not a multi-GB CUDA build.
editable=()
for component in proto model serving draft_service target_service orchestrator deploy bench cli; do
  editable+=(-e "./$component")
done
.venv/bin/python -m pip install --quiet "${editable[@]}" -e '.[test]'
echo "specd installed: .venv/bin/specd"
