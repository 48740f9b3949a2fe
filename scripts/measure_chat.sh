#!/usr/bin/env bash
# Issue 49's chat measurement, one command: default `specd up` (the prefix cache on), `specd up
# --prefix-cache-tokens 0` on other ports, and llama-server (one slot per conversation at once, -t 2,
# its prompt cache on as it is by default), then one `specd loadtest --chat` over the three, one after
# another: CONVERSATIONS conversations of TURNS turns, CONCURRENCY at once, TOKENS tokens an answer.
# JSON, plot and the servers' logs go to OUT_DIR, named by the CPU (docs/performance/under-load.md).
#
#   scripts/measure_chat.sh /path/to/llama-server docs/results
#   CONVERSATIONS=2 TURNS=3 scripts/measure_chat.sh ...   (a shorter run)
set -euo pipefail
cd "$(dirname "$0")/.."
server=${1:?the llama-server binary}
out=${2:?a folder for the results}
conversations=${CONVERSATIONS:-4}
turns=${TURNS:-6}
concurrency=${CONCURRENCY:-4}
tokens=${TOKENS:-32}
tag=${NAME:-$(.venv/bin/python -c 'from specd.bench.loadtest import cpu_tag; print(cpu_tag())')}
gguf=$(.venv/bin/python -c 'from specd.model.store import find_spec, gguf_path; print(gguf_path(find_spec("target")))')
mkdir -p "$out"

# one stack at a time: CPU services load one after another (model/pass_profile.py `alone`) anyway
.venv/bin/specd up >"$out/chat_specd_up_$tag.log" 2>&1 &
cache=$!
trap 'kill $cache ${nocache:-} ${peer:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
wait_for() {  # a log's ready line or a URL's health, up to 10 minutes
  for _ in $(seq 600); do
    if [ -f "$1" ] && grep -q '^ready:' "$1" || { [ "${1#http}" != "$1" ] && curl -sf "$1" >/dev/null; }; then
      return 0
    fi
    sleep 1
  done
  echo "not ready after 10 minutes: $1" >&2
  exit 1
}
wait_for "$out/chat_specd_up_$tag.log"
.venv/bin/specd up --prefix-cache-tokens 0 --port 50151 --draft-port 50152 --target-port 50153 --http-port 8180 \
  --metrics-port 9190 --draft-metrics-port 9191 --target-metrics-port 9192 >"$out/chat_specd_up_nocache_$tag.log" 2>&1 &
nocache=$!
wait_for "$out/chat_specd_up_nocache_$tag.log"
"$server" -m "$gguf" -t 2 -np "$concurrency" -c $((concurrency * 4096)) --port 8080 >"$out/chat_llama_server_$tag.log" 2>&1 &
peer=$!
wait_for http://127.0.0.1:8080/health
echo "three servers up: $(date -u +%H:%M:%S)"
.venv/bin/specd loadtest --server cache=127.0.0.1:50051 --server nocache=127.0.0.1:50151 \
  --openai llama-server=http://127.0.0.1:8080 --chat --conversations "$conversations" --turns "$turns" \
  --concurrency "$concurrency" --max-new-tokens "$tokens" \
  --json "$out/chat_prefix_cache_$tag.json" --plot "$out/chat_prefix_cache_$tag.png"
