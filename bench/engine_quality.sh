#!/usr/bin/env bash
# Engine quality on real weights (SmolLM2-135M-Instruct): TTFT, KL to dense, answer agreement.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/engine_quality.py "$@"
