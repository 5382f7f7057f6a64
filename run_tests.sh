#!/usr/bin/env bash
# Run the whole test suite offline, setting up the environment first if needed.
# Extra arguments go to pytest (for example: ./run_tests.sh -k loss_models -x; -n 0 runs it in one
# process). The tests run side by side, one pytest-xdist worker per core, each module's tests on one
# worker (its fixtures built once), each worker on one torch thread: a thread per core in every
# worker would have them wait for each other's cores.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pytest -n auto --dist loadscope "$@"
