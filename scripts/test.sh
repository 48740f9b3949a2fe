#!/usr/bin/env bash
# Sets up, fetches the default model pair (a no-op once cached), and runs every test.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not real" for the fast suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/specd models fetch
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
