#!/usr/bin/env bash
# Boundary benchmark with the real Qwen3.5 tokenizer and the Qwen3.5 template when available.
# Starts a throwaway redis-server on loopback (if installed) for the Redis and tiered columns.
set -euo pipefail
cd "$(dirname "$0")/.."
template=../shared/chat_templates/Qwen3.5-4B.jinja
args=(--tokenizer qwen3.5 --requests-per-case "${REQUESTS:-200}" --tools "${TOOLS:-0,1,4,16,64}")
[ -f "$template" ] && args+=(--chat-template "$template")
if command -v redis-server >/dev/null; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  dir=$(mktemp -d)
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >/dev/null &
  pid=$!
  trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  args+=(--redis "redis://127.0.0.1:$port/0")
fi
prefix-cache bench "${args[@]}" --output docs/benchmarks-boundary.table.md
