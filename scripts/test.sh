#!/usr/bin/env bash
# Sets up, fetches the default model pair (a no-op once cached), runs every test, and builds the
# documentation site (mkdocs.yml, into site/) with --strict: a broken link, a page missing from the
# nav or a mkdocstrings failure fails it. Extra arguments go to pytest, e.g. scripts/test.sh -m "not real"
# for the fast loop (docs/getting-started.md, "Running the tests"). The 30 slowest tests are listed at
# the end of every run: where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/specd models fetch --engine transformers  # every engine's files: the tests load the pair on both
status=0
.venv/bin/python -m pytest --durations=30 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  status=1
fi
# NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, not a warning about these docs. No --quiet:
# it hides the warnings, and then --strict counts none.
if ! NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict; then
  echo "the documentation site does not build: mkdocs build --strict failed (see above)" >&2
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
