#!/usr/bin/env bash
# Issue 39's scaling check on the simulated engine (every figure it gives is simulated): for each N in
# REPLICAS, `specd up --engine sim --draft-engine sim --target-replicas N --draft-replicas N` (GPU
# profile, time scaled by SCALE so that 2 cores keep up with the simulated passes), then `specd loadtest
# --unique-prompts` at 8 streams per replica, 16 requests per replica, 48 tokens. JSON per N in
# OUT_DIR, and the plot of throughput against replicas (scripts/plot_sim_pool.py).
#
#   scripts/measure_sim_pool.sh docs/results            (REPLICAS="1 2 4 8 16" SCALE=25 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?a folder for the results}
scale=${SCALE:-25}
mkdir -p "$out"
replicas=${REPLICAS:-1 2 4 8 16}
for n in $replicas; do
  log=$(mktemp)
  .venv/bin/specd up --engine "sim:scale=$scale" --draft-engine "sim:scale=$scale" --target-replicas "$n" \
    --draft-replicas "$n" --port 50061 --draft-port 50062 --target-port 50063 --draft-metrics-port 9462 \
    --target-metrics-port 9463 --metrics-port 9461 --http-port 8091 >"$log" 2>&1 &
  up=$!
  for _ in $(seq 300); do grep -q '^ready:' "$log" && break; kill -0 $up 2>/dev/null || { cat "$log"; exit 1; }; sleep 1; done
  echo "$n target replicas up: $(date -u +%H:%M:%S)"
  .venv/bin/specd loadtest --server "sim-$n-replicas=127.0.0.1:50061" --unique-prompts --concurrency $((8 * n)) \
    --requests $((16 * n)) --max-new-tokens 48 --json "$out/sim_pool_${n}_replicas.json"
  kill $up; wait $up 2>/dev/null || true
done
.venv/bin/python scripts/plot_sim_pool.py "$out" $replicas
