#!/usr/bin/env bash
# Demo: serve the bundled SmolLM2 on a loopback port, ask one chat question with curl, stop.
# Run `bash scripts/setup.sh` once first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
URL="http://127.0.0.1:$PORT"
LOG=$(mktemp -t armserve-demo.XXXXXX.log)

# Prefer the installed console script; fall back to the module (same code).
if command -v armserve >/dev/null 2>&1; then ARMSERVE=(armserve); else ARMSERVE=("$PY" -m armserve.cli); fi

echo "starting armserve on $URL (log: $LOG)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "${ARMSERVE[@]}" serve --host 127.0.0.1 --port "$PORT" \
    --max-model-len 2048 --kv-cache-space 0.5 >"$LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do  # loading the model takes ~15-30 s
    if curl -sf "$URL/health" >/dev/null; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "the server exited:"; cat "$LOG"; exit 1; fi
    sleep 0.5
done
curl -sf "$URL/health" >/dev/null || { echo "the server did not become healthy:"; cat "$LOG"; exit 1; }

MODEL=$(curl -sf "$URL/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
QUESTION="What is the capital of France? Answer in one sentence."
echo "Q: $QUESTION"
RESPONSE=$(curl -sf "$URL/v1/chat/completions" -H "Content-Type: application/json" -d "{
  \"model\": \"$MODEL\",
  \"messages\": [{\"role\": \"user\", \"content\": \"$QUESTION\"}],
  \"max_tokens\": 64,
  \"temperature\": 0
}")
echo "A: $(echo "$RESPONSE" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"].strip())')"
echo "usage: $(echo "$RESPONSE" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["usage"])')"
