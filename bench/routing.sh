#!/usr/bin/env bash
# Routing benchmark: round_robin vs prefix_affinity over serve-engine replicas behind one sidecar.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/openblas.sh
exec python3 bench/routing.py "$@"
