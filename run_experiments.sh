#!/usr/bin/env bash
# Main job. For now: a demo of the loss models (configured vs observed statistics).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
exec "$PY" -m lossysim demo "$@"
