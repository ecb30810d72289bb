#!/usr/bin/env bash
# Does a layer-truncated SpecPrefill draft find the answer? (demo chat model)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 bench/draft_recall.py "$@"
