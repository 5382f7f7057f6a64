#!/usr/bin/env bash
# The benchmarks that take --device, and a small loss budget, on one accelerator, one after another, each
# under its own time limit, every figure into one folder: what a session with a GPU for a few minutes runs.
#
#   benchmarks/on_device.sh [DEVICE] [OUT] [LIMIT_S]      # defaults: cuda, results/on_device, 120
#
# Each command's output goes to OUT/<name>.txt and its exit status (124: it ran past LIMIT_S) to
# OUT/status.txt, so a limit reached by one benchmark leaves the others' figures. The CPU-side timings
# inside the benchmarks keep one torch thread (--threads 1), as everywhere in lossysim.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE="${1:-cuda}"
OUT="${2:-results/on_device}"
LIMIT="${3:-120}"
PY="${PY:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
mkdir -p "$OUT"
: > "$OUT/status.txt"

step() {   # step NAME COMMAND...
    local name="$1"; shift
    local start=$SECONDS
    timeout "$LIMIT" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc $(( SECONDS - start )) s" >> "$OUT/status.txt"
    tail -n 3 "$OUT/$name.txt" | sed "s/^/[$name] /"
}

"$PY" -c "import torch; print('torch', torch.__version__, 'device', '$DEVICE', \
torch.cuda.get_device_name(0) if '$DEVICE' == 'cuda' and torch.cuda.is_available() else '')" > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
step loss_models "$PY" benchmarks/bench_loss_models.py --device "$DEVICE" --threads 1 --repeats 5
step collectives "$PY" benchmarks/bench_collectives.py --device "$DEVICE" --threads 1 --repeats 3
step tensor_parallel "$PY" benchmarks/bench_tensor_parallel.py --quick --device "$DEVICE" --threads 1 --no-dist \
    --no-memory --repeats 5 --warmup 2
step pipeline "$PY" benchmarks/bench_pipeline.py --device "$DEVICE" --repeats 3
step context "$PY" benchmarks/bench_context.py --device "$DEVICE" --threads 1 --repeats 3
step padding "$PY" benchmarks/bench_padding.py --device "$DEVICE"
# DP's zero-filled point at 10% on the real model (6 runs, 3 loss-free), the budget's own command
step budget "$PY" -m lossysim budget --out "$OUT/budget" --families dp --policies zero --steps 6 --seeds 3 \
    --grid 0.1 --refine 0 --nics none --jobs 1 --no-progress --set "device=$DEVICE"
cat "$OUT/status.txt"
