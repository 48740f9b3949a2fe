#!/usr/bin/env bash
# Issue 39's routing check on the simulated engine (every figure it gives is simulated): two stacks
# of REPLICAS target and REPLICAS draft replicas each (`--engine sim`, GPU profile, time x SCALE), one
# with --routing prefix (the default), one with --routing round-robin, both up at once; then one
# `specd loadtest --shared-prefixes CONTEXTS` against both in turn, same requests: many users over
# CONTEXTS shared ~1,000-token contexts. Writes OUT_DIR/sim_routing.{json,png}.
#
#   scripts/measure_sim_routing.sh docs/results   (REPLICAS=4 CONTEXTS=32 REQUESTS=512 CONCURRENCY=32 SCALE=10)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?a folder for the results}
replicas=${REPLICAS:-4}
scale=${SCALE:-10}
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT
start() {  # start ROUTING BASE: orchestrator on 500BASE, drafts 500(BASE+1)+100 i, targets 500(BASE+2)+100 i
  local routing=$1 base=$2 log
  log=$(mktemp)
  .venv/bin/specd up --engine "sim:scale=$scale" --draft-engine "sim:scale=$scale" --routing "$routing" \
    --target-replicas "$replicas" --draft-replicas "$replicas" --port "500$base" \
    --draft-port "500$((base + 1))" --target-port "500$((base + 2))" --metrics-port "94$base" \
    --draft-metrics-port "94$((base + 1))" --target-metrics-port "94$((base + 2))" --http-port "80$base" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do grep -q '^ready:' "$log" && return; kill -0 "${pids[-1]}" 2>/dev/null || { cat "$log"; exit 1; }; sleep 1; done
  cat "$log"; exit 1
}
start prefix 71
start round-robin 81
echo "both stacks up: $(date -u +%H:%M:%S)"
.venv/bin/specd loadtest --server "prefix=127.0.0.1:50071" --server "round-robin=127.0.0.1:50081" \
  --shared-prefixes "${CONTEXTS:-32}" --concurrency "${CONCURRENCY:-32}" --requests "${REQUESTS:-512}" \
  --max-new-tokens 32 --json "$out/sim_routing.json" --plot "$out/sim_routing.png"
