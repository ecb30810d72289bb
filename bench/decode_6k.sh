#!/usr/bin/env bash
# Decode after the first token at a 6k context: ours (in-process and serve-engine) vs
# mlx_lm.server on the demo model, alternating; OpenBLAS preloaded (bench/openblas.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/decode_6k.py "$@"
