#!/usr/bin/env bash
# Cuts the default pair for the lent GPU machine, which reaches no registry and takes 64 MiB a call:
# the draft's GGUF then the target's, end to end, in chunks under .xfer/ (c00 of 30 MiB, so that it
# travels with the wheels in .whl/, then 58 MiB each: 27 chunks for the pair). Each chunk goes over
# in a call of its own, back to back while the machine is warm (about 4 s a call):
#   run carry=[".xfer/cNN"]  command="mkdir -p /root/gs && mv .xfer/c* /root/gs/"
# then one call runs the check on the real pair (about 250 s on an H200, conversion included):
#   run command="mv /root/gs/whl .whl; RESULTS=$OUT SPECD_GPU_CHUNKS=/root/gs bash scripts/gpu_check.sh"
# (send .whl/ with c00 and move it to /root/gs/whl: a folder that is not git-ignored there is
# replaced by the working tree at every call). The GGUFs are read from the model store, so
# `specd models fetch` first. Wheels for .whl/ (the machine's Python is 3.12; pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d .whl ...): transformers,
# tokenizers, gguf, grpcio, grpcio-health-checking, grpcio-reflection, protobuf, opentelemetry-api,
# prometheus-client and pytest-asyncio, each at specd's pin.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .xfer && mkdir -p .xfer
grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo '/.xfer/' >>.git/info/exclude
files=$(.venv/bin/python -c "from specd.model.store import DEFAULT_PAIR, gguf_path; print(*(gguf_path(s) for s in DEFAULT_PAIR))")
# shellcheck disable=SC2086
cat $files >.xfer/pair
head -c $((30 * 1048576)) .xfer/pair >.xfer/c00
tail -c +$((30 * 1048576 + 1)) .xfer/pair | split -b $((58 * 1048576)) -d -a 2 --numeric-suffixes=1 - .xfer/c
rm .xfer/pair
ls .xfer | wc -l | xargs echo "chunks in .xfer:"
