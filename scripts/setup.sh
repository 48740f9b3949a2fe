#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs every specd component with the test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# step LABEL COMMAND...: runs COMMAND with a line when it starts, every 30 s while it runs (pip
# --quiet says nothing for minutes while it builds llama-cpp-python), and when it ends.
step() {
  local label=$1 started=$SECONDS status=0
  shift
  echo "setup: $label"
  # sleep's output goes nowhere, so a reader of this script's output is not kept waiting on it.
  (while sleep 30 >/dev/null 2>&1; do echo "setup: still $label ($((SECONDS - started)) s)"; done) &
  local ticker=$!
  "$@" || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  if [ "$status" -eq 0 ]; then
    echo "setup: done $label in $((SECONDS - started)) s"
  fi
  return "$status"
}

python=${PYTHON:-python3.11}
fresh=
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $python" "$python" -m venv .venv
  fresh=1
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned exactly in model/pyproject.toml (torch==2.13.0). That pin matches both the CPU wheel
# (2.13.0+cpu, which this machine's pip configuration finds in its find-links folder, PIP_FIND_LINKS /
# pip.conf) and PyPI's Linux wheel of 2.13.0, which is the CUDA build; pip prefers the +cpu one.
# - Without an NVIDIA driver (no `nvidia-smi -L`): nothing to do here; the install below takes the CPU
#   wheel as before, not a multi-GB CUDA build.
# - With one: install the CUDA build of the same pin first: `torch===2.13.0` matches 2.13.0 and not
#   2.13.0+cpu, and PIP_FIND_LINKS=" " sets the find-links folder aside for this one command. The
#   install below then finds its pin satisfied. PyPI's 2.13.0 is built for CUDA 13.0 (it needs a
#   recent driver, 580 or later); if it cannot be installed, the CPU wheel stays, with a warning.
# SPECD_TORCH=cpu|cuda overrides the detection (a torch already installed that meets the pin stays:
# `.venv/bin/pip uninstall torch` first to switch builds). Untested on a GPU machine: only the CPU
# path has run here (and in CI); the CUDA path's pip resolution was checked with --dry-run.
torch_build=${SPECD_TORCH:-auto}
if [ "$torch_build" = auto ]; then
  torch_build=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    torch_build=cuda
  fi
fi
if [ "$torch_build" = cuda ]; then
  torch_pin=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' model/pyproject.toml)
  if ! PIP_FIND_LINKS=" " step "NVIDIA driver found: installing the CUDA build of torch $torch_pin (PyPI's)" \
    .venv/bin/python -m pip install --quiet "torch===$torch_pin"; then
    echo "warning: could not install the CUDA build of torch $torch_pin; installing the CPU wheel:" \
      "the models will compute on the CPU" >&2
  fi
fi
# Every component folder is a distribution of its own (PEP 420 parts of the `specd` namespace);
# one pip command installs them all, editable, with the workspace's test tools.
editable=()
for component in proto model serving draft_service target_service orchestrator deploy bench cli; do
  editable+=(-e "./$component")
done
if [ -n "$fresh" ]; then
  echo "setup: a first install takes minutes: llama-cpp-python builds from source (~6 min on 2 cores) unless pip's cache has its wheel"
fi
step "installing specd and its dependencies" .venv/bin/python -m pip install --quiet "${editable[@]}" -e '.[test]'
# The llama.cpp engine's exact mode scores many sessions' positions in one call only where ggml's
# matmuls give each row what it gets alone (batch-invariant): llama-cpp-python's ggml-cpu is rebuilt
# with two small patches for that (scripts/batch_invariant_ggml/; ~1 min once, then from the cache).
# Without them the engine stays exact, in calls of 3 positions (model/llama_cpp_engine.py).
if ! step "patching llama-cpp-python's ggml-cpu (batch-invariant matmuls)" scripts/batch_invariant_ggml/build.sh --install; then
  echo "warning: could not build the patched ggml-cpu; the llama.cpp engine stays exact in calls of" \
    "3 positions, ~2x slower per row under load (tests/test_batch_invariant_ggml.py fails)" >&2
fi
echo "specd installed: .venv/bin/specd"
