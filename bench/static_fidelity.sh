#!/usr/bin/env bash
# Static-prefix fidelity on real weights: questions only the system prompt or tools answer.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/openblas.sh
exec python3 -u bench/static_fidelity.py "$@"
