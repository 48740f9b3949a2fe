#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs specd with its test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $python"
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned exactly in pyproject.toml: the local CPU wheel, not a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet -e '.[test]'
echo "specd installed: .venv/bin/specd"
