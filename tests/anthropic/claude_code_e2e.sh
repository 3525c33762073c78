#!/usr/bin/env bash
# Claude Code (npm @anthropic-ai/claude-code, pinned) in print mode against `lockstep serve`:
# one turn must complete. Usage, from the repository root:
#
#   tests/anthropic/claude_code_e2e.sh [MODEL]        (default qwen2.5-coder-0.5b)
#
# Builds the `lockstep` binary (test profile), installs Claude Code with npm into
# target/claude-code, starts the server on a free port, runs
#   claude --bare -p PROMPT --output-format json --system-prompt ... --tools ""
# with ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY pointing at it, checks the JSON result
# (no error, subtype success, a non-empty answer), and stops the server. Claude Code's own
# system prompt and tool set are ~12k tokens: --system-prompt and --tools "" keep the turn
# within a few seconds of CPU on a small model (LOCKSTEP_CC_FULL=1 runs the full default
# prompt and tools instead, which takes minutes of prefill on two cores).
set -euo pipefail

MODEL="${1:-qwen2.5-coder-0.5b}"
CLAUDE_CODE_VERSION="2.1.332"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
PREFIX="$TARGET/claude-code"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "== building lockstep"
(cd "$ROOT" && cargo build --quiet --profile test -p lockstep-cli)
LOCKSTEP="$TARGET/debug/lockstep"

WRAPPER="$PREFIX/node_modules/@anthropic-ai/claude-code/cli-wrapper.cjs"
if ! [ -f "$WRAPPER" ] || ! node "$WRAPPER" --version 2>/dev/null | grep -q "^$CLAUDE_CODE_VERSION "; then
    echo "== installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $PREFIX"
    npm install --silent --no-audit --no-fund --prefix "$PREFIX" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
fi
echo "== $(node "$WRAPPER" --version)"

# A free port from the kernel.
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
echo "== lockstep serve -m $MODEL --port $PORT"
"$LOCKSTEP" serve -m "$MODEL" --port "$PORT" --api-key e2e-key >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$WORK/serve.log"; echo "server died"; exit 1; fi
    sleep 0.5
done
head -1 "$WORK/serve.log"

PROMPT="Reply with the single word: pong"
if [ "${LOCKSTEP_CC_FULL:-0}" = "1" ]; then
    ARGS=(-p "$PROMPT" --output-format json)
else
    ARGS=(--bare -p "$PROMPT" --output-format json
          --system-prompt "You are a helpful assistant. Be brief." --tools "")
fi
mkdir -p "$WORK/home" "$WORK/cwd"
echo "== claude ${ARGS[*]}"
START=$(date +%s)
(cd "$WORK/cwd" && HOME="$WORK/home" \
    ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=e2e-key \
    DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    timeout 1800 node "$WRAPPER" "${ARGS[@]}" >"$WORK/result.json" 2>"$WORK/claude.err") || {
    echo "claude failed:"; cat "$WORK/claude.err"; cat "$WORK/result.json"; exit 1
}
echo "== claude took $(( $(date +%s) - START )) s"
python3 - "$WORK/result.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
summary = {k: r.get(k) for k in ("type", "subtype", "is_error", "num_turns", "stop_reason", "terminal_reason", "result")}
print(json.dumps(summary))
print("usage:", json.dumps({k: r["usage"].get(k) for k in ("input_tokens", "cache_read_input_tokens", "output_tokens")}))
assert r["type"] == "result" and r["subtype"] == "success", summary
assert r["is_error"] is False, summary
assert r["num_turns"] >= 1 and r["result"].strip(), summary
assert r["usage"]["output_tokens"] >= 1, r["usage"]
print("claude code completed a turn against lockstep serve")
EOF
