#!/usr/bin/env bash
# The quality/TTFT frontier on real weights (SmolLM2-135M-Instruct): (b), (c), (d) over keep shares.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/engine_frontier.py "$@"
