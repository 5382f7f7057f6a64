"""A sweep cut across machines: ``--shard K/N`` (or ``auto``, from a Slurm job array), disjoint shards that
cover the grid and are the same on every machine."""
from __future__ import annotations

import os
from typing import Optional

from .names import Run


def parse_shard(text: Optional[str], environ: Optional[dict] = None) -> tuple[int, int]:
    """``K/N`` -> (K, N); ``auto`` reads them from a Slurm job array (see slurm_shard)."""
    if not text:
        return 1, 1
    if text.strip() == "auto":
        return slurm_shard(os.environ if environ is None else environ)
    k, slash, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 2/3") from None
    if not slash or n < 1 or not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: expected K/N with 1 <= K <= N")
    return k, n


def slurm_shard(environ) -> tuple[int, int]:
    """(K, N) of this task of a Slurm job array: tasks MIN, MIN+STEP, ... are shards 1..COUNT."""
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
    if not environ.get(names[0]):
        raise ValueError("--shard auto: not a Slurm job array task (SLURM_ARRAY_TASK_ID is not set); "
                         "submit with sbatch --array, or give --shard K/N")
    values = {}
    for name in (*names, "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_MAX"):
        text = environ.get(name)
        if text in (None, ""):
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"--shard auto: {name}={text!r} is not a whole number") from None
    task, low, step = values[names[0]], values.get(names[1], 0), values.get("SLURM_ARRAY_TASK_STEP", 1)
    count = values.get(names[2])
    if count is None and "SLURM_ARRAY_TASK_MAX" in values:
        count = (values["SLURM_ARRAY_TASK_MAX"] - low) // max(step, 1) + 1
    if count is None:
        raise ValueError("--shard auto: SLURM_ARRAY_TASK_COUNT (or SLURM_ARRAY_TASK_MAX) is not set")
    if step < 1 or (task - low) % step:
        raise ValueError(f"--shard auto: task {task} is not in the array {low}:{step} "
                         "(SLURM_ARRAY_TASK_MIN / SLURM_ARRAY_TASK_STEP)")
    k = (task - low) // step + 1
    if count < 1 or not 1 <= k <= count:
        raise ValueError(f"--shard auto: SLURM_ARRAY_TASK_ID={task} is outside the array "
                         f"(SLURM_ARRAY_TASK_MIN={low}, SLURM_ARRAY_TASK_COUNT={count}); an array "
                         "with gaps (--array=1,5,9) cannot be sharded, use a range such as --array=0-7")
    return k, count


def shard(runs: list[Run], k: int, n: int) -> list[Run]:
    """Shard k of n (1-based): disjoint, covering, the same on every machine (sorted by hash)."""
    ordered = sorted(runs, key=lambda r: (r.key, r.dir_name))
    mine = {r.key for i, r in enumerate(ordered) if i % n == k - 1}
    return [r for r in runs if r.key in mine]   # keep grid order: baselines first, as written
