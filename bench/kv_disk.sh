#!/usr/bin/env bash
# KV disk tier benchmark: TTFT of the first request after an engine restart, with vs without
# the disk tier (and a second engine process on the same folder). OpenBLAS preloaded as in
# bench/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = Linux ] && [ -z "${LD_PRELOAD:-}" ]; then
  blas=$(ldconfig -p 2>/dev/null | awk '/libopenblas\.so\.0 .*x86-64/ {print $NF; exit}')
  [ -n "$blas" ] && export LD_PRELOAD="$blas"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/kv_disk.py "$@"
