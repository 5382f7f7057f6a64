#!/usr/bin/env bash
# Main job: a sweep of packet-loss experiments, then its report (table and plots).
# With no arguments: the quick offline profile (experiments/quick.yaml). --help lists the options.
# Options are parsed before any set-up, so --help and mistakes cost nothing.
set -euo pipefail

# The command as typed (settings from the environment first), to say how to resume an interrupted sweep.
RERUN=""
for name in LOSSYSIM_PROFILE LOSSYSIM_RATES LOSSYSIM_BURST LOSSYSIM_TP LOSSYSIM_SEEDS LOSSYSIM_BACKEND \
  LOSSYSIM_NPROC LOSSYSIM_STEPS LOSSYSIM_OUT LOSSYSIM_SHARD LOSSYSIM_JOBS LOSSYSIM_THREADS; do
  if [ -n "${!name:-}" ]; then
    RERUN+="$name=$(printf '%q' "${!name}") "
  fi
done
case "$0" in */*) RERUN+="$(printf '%q' "$0")" ;; *) RERUN+="./$(printf '%q' "$0")" ;; esac
if [ $# -gt 0 ]; then
  RERUN+="$(printf ' %q' "$@")"
fi
cd "$(dirname "$0")"

usage() {
  cat <<'EOF'
Usage: ./run_experiments.sh [options]

Runs a sweep of tensor-, data-, pipeline- or context-parallel trainings under packet loss, prints
the simulated time to reach a target accuracy and accuracy against loss rate, and writes
the report (accuracy against simulated time first, then plots, report.md, summary.csv)
into the output folder. A sweep that is stopped resumes where it left off when the same
command runs again.

Profiles:
  quick  (default) tiny GPT-2 on the synthetic NLI task (synthetic, not MNLI), offline,
         2 simulated ranks on two nodes over 200G RoCE, 3 seeds (95% intervals and tests
         against no loss): ring all-reduce under Bernoulli 1%, 5%, 20% and Gilbert-Elliott
         5%; direct exchange at 20%; at 1%, 5%, 20%: retransmit as a selective-repeat
         NIC (irn) and RoCE go-back-N (roce-gbn) repair, each also timed under the ideal
         NIC, and deadline (3x); a 2 nodes x 2 ranks layout losing only between nodes.
         51 runs, about 10 minutes
         on 2 idle CPU cores. Spec: experiments/quick.yaml
  mitigations
         the quick profile's model and cluster, ring all-reduce, drop: the recovery
         policies zero, rescale, hadamard, hadamard+rescale, stale, error_feedback,
         outliers and outliers+hadamard under Bernoulli 5% and 20% and Gilbert-Elliott
         5% (burst 8), 3 seeds, beside the loss-free baseline. 75 runs.
         Spec: experiments/mitigations.yaml
  dp     which traffic should the lossy network carry? tp 2 x dp 2 on the quick profile's
         task: loss only between nodes on data-parallel gradients (tp inside nodes; zero
         and rescale) or on tensor-parallel traffic (tp across nodes), at 1% and 5%,
         3 seeds; accuracy, drift and time side by side. 21 runs, about 8 minutes.
         Spec: experiments/data_parallel.yaml
  pp     what lost activations and their gradients between pipeline stages do: tp 1 and
         tp 2 x pp 2 on the quick profile's task (1F1B, 2 micro-batches), a stage per node,
         loss only on PP traffic between the nodes at 1% and 5%: zero, rescale, hadamard
         (dropped) against retransmit (irn), each layout beside its loss-free run; and the
         same 5% on DP gradients (tp 1 x dp 2) and on TP traffic (tp 2 across nodes); and
         3-D, tp 2 x pp 2 x dp 2 a rank per node, 5% on TP, PP or DP traffic alone or on all.
         3 seeds, 150 steps; accuracy, bubble, time per step and observed PP loss side by
         side. 81 runs, about 20 minutes on 2 idle CPU cores. Spec: experiments/pipeline.yaml
  moe    what a lost expert dispatch or combine packet does: a tiny Mixtral-like MoE on the quick
         profile's task, its experts over ep 2 (a replica per node), loss only between the
         nodes at 1% and 5% on the dispatch, on the combine and on both: zero, drop_token (the
         expert skips the token) and retransmit (irn), beside its loss-free run; the same loss
         on its dense gradient buckets, and on TP traffic (tp 2 across the nodes). 3 seeds,
         100 steps. 72 runs, about 8 minutes on 2 CPU cores. Spec: experiments/moe.yaml
  cp     what lost keys and values do between context-parallel ranks: the tiny GPT-2 as a
         byte-level causal LM on Python's documentation text (pydoc, offline), pieces of up
         to 128 bytes cut into 4 chunks, tp 1 x cp 2 with a context rank per node, the keys,
         values and their gradients losing 1% and 5% between the nodes: zero-filled,
         masked out of the softmax (mask) or retransmitted (irn); beside the same loss on
         TP traffic (tp 2 across the nodes), each beside its loss-free runs, 3 seeds, 60
         steps; perplexity, time per step and observed loss side by side. 30 runs, about
         4 minutes on 2 CPU cores. Spec: experiments/context.yaml
  real   a real pretrained model, offline (needs the real extra: see the README's "Real
         model, offline"): SmolLM2-135M (weights dequantised from Q4_1) on Python's
         documentation text. First a reduced damage map into <out>/damage_map/ (forward
         only, tp 3, loss on one site at a time: layers 0-2, 11, 28, 29 x attention, MLP,
         Bernoulli 1% and 5%, zero, hadamard, outliers and outliers+hadamard, pretrained
         and random weights), then causal-LM fine-tuning under loss, 3 seeds each (6 steps
         of 4 x 64 tokens, lr 1e-4, eval loss-free on 48 held-out pieces): tp 3 with TP
         traffic lost at 0.1%, 1%, 5% (zero; rescale, hadamard, outliers and
         outliers+hadamard at 1%) and tp 1 x dp 2 with gradients lost at 10% (zero,
         rescale), beside their loss-free runs. 33 runs; the report adds the damage map
         and the perplexity table. About 30 minutes on 2 idle CPU cores.
         Spec: experiments/real.yaml
  mnli   pretrained gpt2 on MNLI (20k train, 2k eval per split), tp 2; torchrun (dist)
         with >= 2 GPUs, simulated ranks (sim) otherwise. Spec: experiments/mnli_sweep.yaml
         (the first run downloads gpt2 and MNLI unless HF_HUB_OFFLINE=1)

Options (each also read from the environment variable shown; options win):
  --profile NAME     quick | mitigations | dp | pp | moe | cp | real | mnli [LOSSYSIM_PROFILE]
  --rates "R ..."    average loss rates, fractions or percents,      [LOSSYSIM_RATES]
                     e.g. "0 0.01 5%"; each gives a Bernoulli and a Gilbert-Elliott run
                     in every comparison of the spec (the loss-free baseline always
                     runs). Default: the spec's.
  --burst "B ..."    Gilbert-Elliott mean burst lengths in packets    [LOSSYSIM_BURST]
                     (default 8 when --rates is given, else the spec's)
  --tp "N ..."       tensor-parallel sizes (default: the spec's, 2)  [LOSSYSIM_TP]
  --seeds "S ..."    seeds (default: the spec's, 0 1 2)              [LOSSYSIM_SEEDS]
  --backend NAME     auto | sim | dist (default auto: dist for mnli  [LOSSYSIM_BACKEND]
                     with >= 2 GPUs, else sim)
  --nproc N          GPUs a dist run may use (default: detected);    [LOSSYSIM_NPROC]
                     auto picks dist when N >= 2; tp sizes must be <= N
  --steps N          optimizer steps per run (default: the spec's)   [LOSSYSIM_STEPS]
  --out DIR          output folder (default results/<profile>)       [LOSSYSIM_OUT]
  --shard K/N        run part K of N (N machines, one results folder) [LOSSYSIM_SHARD]
                     auto: K/N of this Slurm array task (see experiments/sweep_array.sbatch)
  --jobs N           runs side by side, each its own process         [LOSSYSIM_JOBS]
                     (default: the cores available; dist runs one at a time)
  --threads N        torch's intra-op threads of each run (default 1) [LOSSYSIM_THREADS]
  --set KEY=VALUE    any other config key (repeatable; see lossysim/config.py)
  --dry-run          list the runs and what is already done; train nothing
  -h, --help         this help

Examples:
  ./run_experiments.sh
  ./run_experiments.sh --rates "0 1% 5%" --burst "4 16" --seeds "0 1 2"
  ./run_experiments.sh --profile mitigations
  ./run_experiments.sh --profile pp
  ./run_experiments.sh --profile moe
  ./run_experiments.sh --profile cp
  ./run_experiments.sh --profile real
  ./run_experiments.sh --profile mnli --shard 1/2 --out /shared/results/mnli
EOF
}

die() {
  echo "run_experiments.sh: $1" >&2
  exit 2
}

bad_usage() {
  echo "run_experiments.sh: $1" >&2
  usage >&2
  exit 2
}

is_count() {
  case "$1" in
    '' | *[!0-9]*) return 1 ;;
    *) [ "$1" -ge 1 ] ;;
  esac
}

PROFILE="${LOSSYSIM_PROFILE:-quick}"
RATES="${LOSSYSIM_RATES:-}"
BURSTS="${LOSSYSIM_BURST:-}"
TP_SIZES="${LOSSYSIM_TP:-}"
SEEDS="${LOSSYSIM_SEEDS:-}"
BACKEND="${LOSSYSIM_BACKEND:-auto}"
NPROC="${LOSSYSIM_NPROC:-}"
STEPS="${LOSSYSIM_STEPS:-}"
OUT="${LOSSYSIM_OUT:-}"
SHARD="${LOSSYSIM_SHARD:-}"
JOBS="${LOSSYSIM_JOBS:-}"
THREADS="${LOSSYSIM_THREADS:-}"
DRY_RUN=0
SETS=()

while [ $# -gt 0 ]; do
  case "$1" in
    --*=*)
      opt="${1%%=*}"
      val="${1#*=}"
      shift
      set -- "$opt" "$val" "$@"
      continue
      ;;
  esac
  case "$1" in
    -h | --help)
      usage
      exit 0
      ;;
    --dry-run)
      DRY_RUN=1
      shift
      continue
      ;;
    --profile | --rates | --burst | --tp | --seeds | --backend | --nproc | --steps | --out | --shard | --jobs | \
      --threads | --set)
      [ $# -ge 2 ] || bad_usage "$1 needs a value"
      ;;
    *)
      bad_usage "unknown option: $1"
      ;;
  esac
  case "$1" in
    --profile) PROFILE="$2" ;;
    --rates) RATES="$2" ;;
    --burst) BURSTS="$2" ;;
    --tp) TP_SIZES="$2" ;;
    --seeds) SEEDS="$2" ;;
    --backend) BACKEND="$2" ;;
    --nproc) NPROC="$2" ;;
    --steps) STEPS="$2" ;;
    --out) OUT="$2" ;;
    --shard) SHARD="$2" ;;
    --jobs) JOBS="$2" ;;
    --threads) THREADS="$2" ;;
    --set) SETS+=(--set "$2") ;;
  esac
  shift 2
done

case "$PROFILE" in
  quick) SPEC=experiments/quick.yaml ;;
  mitigations) SPEC=experiments/mitigations.yaml ;;
  dp) SPEC=experiments/data_parallel.yaml ;;
  pp) SPEC=experiments/pipeline.yaml ;;
  moe) SPEC=experiments/moe.yaml ;;
  cp) SPEC=experiments/context.yaml ;;
  real) SPEC=experiments/real.yaml ;;
  mnli) SPEC=experiments/mnli_sweep.yaml ;;
  *) bad_usage "unknown profile: $PROFILE (expected quick, mitigations, dp, pp, moe, cp, real or mnli)" ;;
esac
case "$BACKEND" in
  auto | sim | dist) ;;
  *) bad_usage "unknown backend: $BACKEND (expected auto, sim or dist)" ;;
esac
for value in $TP_SIZES $SEEDS; do
  case "$value" in
    '' | *[!0-9]*) bad_usage "tp sizes and seeds are whole numbers, got: $value" ;;
  esac
done
if [ -n "$STEPS" ] && ! is_count "$STEPS"; then
  bad_usage "--steps needs a positive whole number, got: $STEPS"
fi
if [ -n "$NPROC" ] && ! is_count "$NPROC"; then
  bad_usage "--nproc needs a positive whole number, got: $NPROC"
fi
if [ -n "$JOBS" ] && ! is_count "$JOBS"; then
  bad_usage "--jobs needs a positive whole number, got: $JOBS"
fi
if [ -n "$THREADS" ] && ! is_count "$THREADS"; then
  bad_usage "--threads needs a positive whole number, got: $THREADS"
fi
OUT="${OUT:-results/$PROFILE}"

source scripts/ensure_env.sh
export TOKENIZERS_PARALLELISM=false
if [ "$PROFILE" != mnli ]; then
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
fi

ARGS=(sweep "$SPEC" --out "$OUT")
if [ -n "$RATES" ] || [ -n "$BURSTS" ]; then
  # Rate 0 gives bernoulli:0 and ge:rate=0, which the sweep merges with the baseline.
  losses="none"
  for rate in ${RATES:-0 0.01 0.05 0.2}; do
    losses="$losses bernoulli:$rate"
    for burst in ${BURSTS:-8}; do
      losses="$losses ge:rate=$rate,burst=$burst"
    done
  done
  ARGS+=(--grid "loss=$losses")
fi
if [ -n "$TP_SIZES" ]; then
  ARGS+=(--grid "tp_size=$TP_SIZES")
fi
if [ -n "$SEEDS" ]; then
  ARGS+=(--grid "seed=$SEEDS")
fi
if [ -n "$STEPS" ]; then
  ARGS+=(--set "steps=$STEPS")
fi
if [ -n "$SHARD" ]; then
  ARGS+=(--shard "$SHARD")
fi
if [ -n "$JOBS" ]; then
  ARGS+=(--jobs "$JOBS")
fi
if [ -n "$THREADS" ]; then
  ARGS+=(--threads "$THREADS")
fi

gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
  fi
}

if [ "$BACKEND" = auto ]; then
  BACKEND=sim
  if [ "$PROFILE" = mnli ]; then
    NPROC="${NPROC:-$(gpu_count)}"
    if [ "$NPROC" -ge 2 ]; then
      BACKEND=dist
    fi
  fi
fi
if [ "$BACKEND" = dist ] && [ -n "$NPROC" ]; then
  for tp in ${TP_SIZES:-2}; do
    if [ "$tp" -gt "$NPROC" ]; then
      die "tp size $tp needs $tp GPUs for the dist backend, but --nproc is $NPROC (use --backend sim)"
    fi
  done
fi
ARGS+=(--set "backend=$BACKEND")
if [ ${#SETS[@]} -gt 0 ]; then
  ARGS+=("${SETS[@]}")
fi

if [ "$DRY_RUN" = 1 ]; then
  exec "$PY" -m lossysim "${ARGS[@]}" --dry-run
fi

# Validate every run first: a bad rate or key, or settings train refuses, fail here, before any training.
"$PY" -m lossysim "${ARGS[@]}" --dry-run >/dev/null
if [ "$PROFILE" = real ]; then
  # Without the real extra nothing can run: say how to install it, in one line, before any work.
  why="$("$PY" -c 'from lossysim.models.pretrained import missing; print(missing("smollm2-135m") or "")')" \
    || die "could not ask $PY whether the real model is installed"
  [ -z "$why" ] || die "$why"
fi
echo "lossysim: profile $PROFILE, backend $BACKEND, spec $SPEC, results in $OUT" >&2
if [ "$PROFILE" = real ] && [ -n "$SHARD" ] && [ "${SHARD#1/}" = "$SHARD" ]; then
  echo "lossysim: the damage map is left to shard 1/N" >&2
elif [ "$PROFILE" = real ] && [ ! -f "$OUT/damage_map/damage_map.png" ]; then
  # The map is written whole at its end (its png last), so one without a png is redone: minutes.
  "$PY" -m lossysim.real.damage_map --out "$OUT/damage_map" --layers 0-2,11,28,29 --rates 0.01,0.05 \
    --recoveries zero,hadamard,outliers,outliers+hadamard
fi
status=0
"$PY" -m lossysim "${ARGS[@]}" || status=$?
if [ "$status" -eq 130 ]; then
  # Ctrl-C: the finished runs are kept, no report of a part of the sweep; the same command resumes.
  echo "run_experiments.sh: interrupted; the finished runs in $OUT are kept (no report written)." >&2
  echo "To resume where it stopped, run the same command again:" >&2
  echo "  $RERUN" >&2
  exit 130
fi

echo
echo "Accuracy against average packet loss rate and burstiness ($PROFILE profile):"
"$PY" -m lossysim report "$OUT"

echo
echo "Finished in $((SECONDS / 60)) min $((SECONDS % 60)) s. Everything is in $OUT/:"
echo "  report.md    tables (simulated time to accuracy; every setting: accuracy, observed loss,"
echo "               disagreement, failures)"
echo "  summary.csv  one row per run (simulated clock, retransmitted and missing packets included)"
echo "  *.png        plots: accuracy against simulated time; accuracy and disagreement against"
echo "               loss rate, observed against configured loss, accuracy during training"
echo "  */           one directory per run: config.yaml, metrics.jsonl, summary.json"
if [ "$status" -eq 3 ]; then   # the sweep's status when some runs failed (it says how many above)
  echo "run_experiments.sh: some runs failed (see the sweep's lines above and report.md); run the same" \
    "command again to retry them: $RERUN" >&2
elif [ "$status" -ne 0 ]; then
  echo "run_experiments.sh: the sweep stopped with exit status $status (its error is above)" >&2
fi
exit "$status"
