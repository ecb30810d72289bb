#!/usr/bin/env bash
# SpecPrefill on sliding-window and recurrent families against dense: TTFT at 8k and 16k,
# KL to dense, answers equal to dense (bench/hybrid_specprefill.py). OpenBLAS preloaded as in
# bench/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/hybrid_specprefill.py "$@"
