#!/usr/bin/env bash
# Sets up, fetches the default model pair (a no-op once cached), runs every test, and builds the
# documentation site (mkdocs.yml, into site/) with --strict: a broken link, a page missing from the
# nav or a mkdocstrings failure fails it. Extra arguments go to pytest, e.g. scripts/test.sh -m "not real"
# for the fast loop (docs/getting-started.md, "Running the tests"). The 30 slowest tests are listed at
# the end of each of its two pytest runs: where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/specd models fetch --engine transformers  # every engine's files: the tests load the pair on both
# Two runs of pytest: the tests that may share the machine, two at a time (pytest-xdist, whole files to a
# worker, so module fixtures load once); then, one at a time, those that may not: the real pair's (a model
# load beside another would double the peak memory) and those marked `serial` (their timings assume the
# machine to themselves). tests/conftest.py's --phase sorts them.
status=0 collected=0
for phase in parallel serial; do
  workers=()
  [ "$phase" = parallel ] && workers=(-n 2 --dist loadfile)
  code=0
  .venv/bin/python -m pytest --phase "$phase" "${workers[@]}" --durations=30 "$@" || code=$?
  if [ "$code" -eq 5 ]; then
    code=0  # nothing of this phase among the tests asked for
  else
    collected=1
  fi
  [ "$code" -eq 0 ] || status=$code
done
if [ "$collected" -eq 0 ]; then
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
