#!/usr/bin/env bash
# Boundary benchmark with the real Qwen3.5 tokenizer and the Qwen3.5 template when available.
set -euo pipefail
cd "$(dirname "$0")/.."
template=../shared/chat_templates/Qwen3.5-4B.jinja
args=(--tokenizer qwen3.5 --requests-per-case "${REQUESTS:-200}" --tools 0,1,4,16,64)
[ -f "$template" ] && args+=(--chat-template "$template")
prefix-cache bench "${args[@]}" --output docs/benchmarks-boundary.table.md
