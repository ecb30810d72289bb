#!/usr/bin/env bash
# The demo chat model's dtype: float32 against the GGUF's 4-bit blocks, prefill and decode.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/demo_dtype.py "$@"
