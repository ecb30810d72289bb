#!/usr/bin/env bash
# SpecPrefill on sliding-window and recurrent families against dense: TTFT at 8k and 16k,
# KL to dense, answers equal to dense (bench/hybrid_specprefill.py). OpenBLAS preloaded as in
# bench/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = Linux ] && [ -z "${LD_PRELOAD:-}" ]; then
  blas=$(ldconfig -p 2>/dev/null | awk '/libopenblas\.so\.0 .*x86-64/ {print $NF; exit}')
  [ -n "$blas" ] && export LD_PRELOAD="$blas"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/hybrid_specprefill.py "$@"
