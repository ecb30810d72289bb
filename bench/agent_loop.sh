#!/usr/bin/env bash
# A chat loop and an agent tool loop sending replies back: ours vs mlx_lm.server vs vllm-mlx.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/agent_loop.py "$@"
