#!/usr/bin/env bash
# Constrained decoding's cost per decode step: free against grammar-masked rows, batch 1 and 8.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/grammar_mask.py "$@"
