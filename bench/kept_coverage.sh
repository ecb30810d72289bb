#!/usr/bin/env bash
# What SpecPrefill keeps of the document with and without the boundary (demo chat model).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/kept_coverage.py "$@"
