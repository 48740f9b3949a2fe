#!/usr/bin/env bash
# Issue 40's chaos table on the simulated engine (every figure it gives is simulated): for each fault,
# a fresh stack of 4 target and 2 draft replicas (`--engine sim`, GPU profile, time x SCALE,
# --step-deadline DEADLINE), then scripts/measure_migration.py: 64 greedy requests of 128 tokens at 8
# streams, once without a fault and once with the fault mid-run. Writes OUT_DIR/chaos_<fault>_sim.json.
#
#   scripts/measure_chaos_sim.sh docs/results   (FAULTS="kill stop draft-kill" SCALE=5 DEADLINE=3 STOP_FOR=10)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?a folder for the results}
scale=${SCALE:-5}
mkdir -p "$out"
pid=""
stop_stack() {  # SIGTERM to the stack's process group; wait until its services are gone
  [ -n "$pid" ] && kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 60); do pgrep -f "specd.cli serve" >/dev/null || break; sleep 1; done
  pid=""
}
trap stop_stack EXIT
targets=127.0.0.1:50073,127.0.0.1:50173,127.0.0.1:50273,127.0.0.1:50373
drafts=127.0.0.1:50072,127.0.0.1:50172
for fault in ${FAULTS:-kill stop draft-kill}; do
  log=$(mktemp)
  setsid .venv/bin/specd up --engine "sim:scale=$scale" --draft-engine "sim:scale=$scale" --target-replicas 4 \
    --draft-replicas 2 --step-deadline "${DEADLINE:-3}" --port 50071 --draft-port 50072 --target-port 50073 \
    --metrics-port 9471 --draft-metrics-port 9472 --target-metrics-port 9473 --http-port 8071 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q '^ready:' "$log" && break; kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }; sleep 1; done
  grep -q '^ready:' "$log" || { cat "$log"; exit 1; }
  echo "stack up for $fault: $(date -u +%H:%M:%S)"
  .venv/bin/python scripts/measure_migration.py --server 127.0.0.1:50071 --targets "$targets" --drafts "$drafts" \
    --fault "$fault" --stop-for "${STOP_FOR:-10}" --out "$out/chaos_${fault}_sim.json" || echo "$fault: a request failed or changed"
  stop_stack
done
