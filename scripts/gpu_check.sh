#!/usr/bin/env bash
# The GPU check (issue 15), one command on a machine with an NVIDIA GPU, under 8 minutes on one:
#   1. the `gpu` tests (tests marked gpu: engines, batched verify, greedy speculation equals
#      target-only, seeded sampling, q rows, CUDA graphs equal eager in float32, device OOM; the
#      real pair's greedy speculation with CUDA graphs where the pair is fetched);
#      SPECD_GPU_TESTS_ONLY=1 stops there;
#   2. scripts/gpu_bench.py: HF generate and specd target-only and speculative, eager and with
#      CUDA graphs, on the same GPU; it writes docs/results/gpu_check.json (or $RESULTS/).
#
# Models: the default pair when it is fetched (`specd models fetch`), or SPECD_GPU_TARGET and
# SPECD_GPU_DRAFT; else the pair's architecture (config.json of each) with random weights made
# here. Random weights time a step exactly as the real ones do, but their acceptance rate is not
# the real pair's.
#
# Environment: any Python with a CUDA torch. Where specd is not installed (the lent GPU machine),
# it runs from this checkout; wheels in .whl/ (transformers, grpcio, ... at specd's pins: listed in
# scripts/gpu_send_pair.sh) are installed to a temporary folder first. Folders it reads:
# .gpu/tokenizer, .gpu/target, .gpu/draft (tokenizer files and the pair's config.json).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
results=${RESULTS:-docs/results}
work=${TMPDIR:-/tmp}/specd-gpu-check
mkdir -p "$work" "$results"
export PYTHONUNBUFFERED=1
started=$(date +%s)
say() { echo "[gpu_check $(($(date +%s) - started))s] $*"; }

if ! "$py" -c "import specd.model" 2>/dev/null; then
  say "specd is not installed: running from this checkout"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl
  fi
  mkdir -p "$work/src/specd"
  for component in proto model serving draft_service target_service orchestrator deploy bench cli; do
    ln -sfn "$PWD/$component" "$work/src/specd/$component"
  done
  ln -sfn "$PWD/proto/specd/v1" "$work/src/specd/v1"
  export PYTHONPATH="$work/site:$work/src${PYTHONPATH:+:$PYTHONPATH}"
fi
# The lent GPU machine reaches no registry, and one call carries 64 MiB: scripts/gpu_send_pair.sh
# cuts the default pair's two GGUF files (draft then target, end to end) into chunks that go over
# one call each into .gpustore/ (or $SPECD_GPU_CHUNKS); here they are cut back into the two files,
# and specd's own fetch checks each file's sha256 and converts it, the two side by side.
chunks=${SPECD_GPU_CHUNKS:-.gpustore}
if compgen -G "$chunks/c[0-9][0-9]" >/dev/null; then
  export SPECD_CACHE=${SPECD_CACHE:-$work/cache}
  say "assembling the default pair from $(find "$chunks" -name 'c[0-9][0-9]' | wc -l) chunks in $chunks"
  "$py" - "$chunks" <<'PY'
import sys
from pathlib import Path
from specd.model.store import DEFAULT_PAIR, gguf_path
parts = iter(sorted(Path(sys.argv[1]).glob("c[0-9][0-9]")))
source = next(parts).open("rb")
for spec in DEFAULT_PAIR:  # draft, then target: the order gpu_send_pair.sh wrote them in
    out = gguf_path(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as sink:
        left = spec.size
        while left:
            data = source.read(min(left, 1 << 24))
            if not data:
                source = next(parts).open("rb")
                continue
            sink.write(data)
            left -= len(data)
    print(spec.role, out, out.stat().st_size, "bytes")
PY
  for role in draft target; do
    "$py" -c "from specd.model.fetch import fetch; from specd.model.store import DEFAULT_PAIR as p; fetch([s for s in p if s.role == '$role'], engine='transformers', progress=False)" &
  done
  wait
fi
"$py" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv || true

target=${SPECD_GPU_TARGET:-}
draft=${SPECD_GPU_DRAFT:-}
if [ -z "$target" ] && pair=$("$py" -c "from specd.model.store import resolve_model as r; print(r('target'), r('draft'))" 2>/dev/null); then
  read -r target draft <<<"$pair"
  say "the default pair is fetched: the bench runs it"
fi
if { [ -z "$target" ] || [ -z "$draft" ]; } && [ -z "${SPECD_GPU_TESTS_ONLY:-}" ]; then
  say "making the pair's architecture with random weights (bfloat16)"
  "$py" - "$work/models" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
for seed, role in enumerate(("target", "draft")):
    folder = Path(sys.argv[1]) / role
    if (folder / "config.json").exists():
        continue
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(f".gpu/{role}"), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for file in Path(".gpu/tokenizer").iterdir():
        shutil.copy(file, folder / file.name)
    print(role, sum(p.numel() for p in model.parameters()) / 1e9, "B parameters")
EOF
  target=${target:-$work/models/target}
  draft=${draft:-$work/models/draft}
fi

say "gpu tests"
# The tiny test models take the pair's tokenizer: the fetched draft's, else .gpu/tokenizer's files.
tokenizer=$PWD/.gpu/tokenizer
[ -n "$draft" ] && [ "$draft" != "$work/models/draft" ] && tokenizer=$draft
tests_status=0
SPECD_TEST_TOKENIZER=${SPECD_TEST_TOKENIZER:-$tokenizer} "$py" -m pytest -m gpu -q -p no:cacheprovider \
  --junitxml "$work/gpu_tests.xml" tests/test_devices.py tests/test_engine.py tests/test_prefix_transformers.py \
  tests/test_real_pair.py || tests_status=$?
if [ -n "${SPECD_GPU_TESTS_ONLY:-}" ]; then  # the tests alone (a short lease): no bench
  say "done: tests exit status $tests_status (SPECD_GPU_TESTS_ONLY: no bench)"
  exit "$tests_status"
fi

if "$py" -c "import ray" 2>/dev/null && [ "$target" != "$work/models/target" ]; then
  # Where Ray and the fetched pair are here (an installed GPU node), specd's own bench too, the whole
  # stack (orchestrator on Ray), eager and with graphs. The lent GPU machine has neither.
  for graphs in off on; do
    say "specd bench --quick --cuda-graphs $graphs"
    "$py" -m specd.cli bench --quick --device cuda --cuda-graphs "$graphs" --json "$results/gpu_bench_graphs_$graphs.json"
  done
fi

say "bench"
"$py" scripts/gpu_bench.py --target "$target" --draft "$draft" --device cuda --tests "$work/gpu_tests.xml" \
  --out "$results/gpu_check.json"
say "done: tests exit status $tests_status, results in $results/gpu_check.json"
exit "$tests_status"
