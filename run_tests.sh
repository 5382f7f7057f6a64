#!/usr/bin/env bash
# Run the whole test suite offline, setting up the environment first if needed.
# Extra arguments go to pytest (for example: ./run_tests.sh -k loss_models -x).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest "$@"
