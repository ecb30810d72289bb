#!/usr/bin/env bash
# Gemma 3 270M: turn 2's TTFT cold, after a restart with the disk tier, and with the reply's KV
# kept, side by side in one process. OpenBLAS preloaded as in bench/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/gemma_reuse.py "$@"
