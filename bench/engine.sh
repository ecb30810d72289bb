#!/usr/bin/env bash
# Engine benchmark (TTFT and next-token KL vs dense): mlx_lm.server vs SpecPrefill variants.
# On Linux, mlx's CPU build is much faster with Debian's OpenBLAS preloaded (float32 matmul
# ~36x on 2 cores); the machine line of the report says whether it was.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/engine.py "$@"
