#!/usr/bin/env bash
# KV disk tier benchmark: TTFT of the first request after an engine restart, with vs without
# the disk tier (and a second engine process on the same folder). OpenBLAS preloaded as in
# bench/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/kv_disk.py "$@"
