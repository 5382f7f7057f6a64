"""The gloo processes of the dist-against-sim test modules, and what they leave behind.

Not collected by pytest (no ``test_`` prefix). A module spawns its processes once (spawn, imports and
teardown cost seconds) with a plan: its cases in order, each ``(name, first, world)``, run by processes
``first`` .. ``first + world - 1`` as torchrun ranks 0 .. ``world - 1`` (``MASTER_PORT`` a free port of
the case's own), each process running its cases one after another. A case named ``*-resumed`` is stopped
after its step-2 checkpoint (its later checkpoints, export and summary deleted, its rows kept as
``first-metrics.jsonl``) and resumed on a second port; the test compares it with sim's uninterrupted run.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lossysim.io import read_jsonl

RESUMED = "-resumed"


_PORTS_TAKEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range, new to this process.

    A module picks every case's port before its first case starts, minutes before the last one listens. A
    port from the ephemeral range (``bind(0)``) can meanwhile become the local end of one of gloo's own
    connections, and the case's store then fails with EADDRINUSE; the kernel never hands out ports below
    that range on its own.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768   # Linux's default where the file cannot be read
    candidates = list(range(max(1024, low - 12000), low))
    random.Random(os.getpid() ^ time.monotonic_ns()).shuffle(candidates)
    for port in candidates:
        if port in _PORTS_TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_TAKEN.add(port)
        return port
    raise RuntimeError(f"no free port below {low}")


def _run_cases(index: int, out: str, cache: str, ports: dict, plan: list, settings: dict, setup) -> None:
    """Process ``index``: every case of ``plan`` whose processes include it, as a torchrun rank of that case."""
    from lossysim.run.experiment import run_experiment
    from tiny_runs import tiny_run
    torch.set_num_threads(1)
    os.environ.update(LOSSYSIM_CACHE=cache, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    if setup is not None:
        setup()
    for name, first, world in plan:
        if not first <= index < first + world:
            continue
        rank = index - first
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(ports[name]))
        run_dir = Path(out) / name / "dist"
        config = tiny_run(run_dir, backend="dist", **settings[name])
        summary = run_experiment(config, run_dir, progress=False)
        assert summary["status"] == "completed", (name, summary.get("error"), summary.get("diverged_at"))
        if name.endswith(RESUMED):   # killed after its step-2 checkpoint: the rest is gone
            if rank == 0:
                shutil.copy(run_dir / "metrics.jsonl", run_dir.parent / "first-metrics.jsonl")
                shutil.rmtree(run_dir / "checkpoints" / "step-0000004")
                shutil.rmtree(run_dir / "checkpoint")
                (run_dir / "summary.json").unlink()
            os.environ["MASTER_PORT"] = str(ports[f"resume-{name}"])
            summary = run_experiment(config, run_dir, progress=False, resume=True)
            assert summary["status"] == "completed", (name, summary.get("error"), summary.get("diverged_at"))


def spawn_runs(tmp_path_factory, label: str, plan: list, settings: dict, processes: int, deadline_s: float,
               setup=None) -> Path:
    """``processes`` gloo processes through ``plan`` (``settings``: each case's ``tiny_run`` settings;
    ``setup``: a module-level function each process calls first); every case's directory, by name."""
    out = tmp_path_factory.mktemp(label)
    cache = tmp_path_factory.getbasetemp() / "cache"
    names = [name for name, _, _ in plan]
    ports = {name: free_port() for name in [*names, *(f"resume-{n}" for n in names if n.endswith(RESUMED))]}
    workers = mp.start_processes(_run_cases, args=(str(out), str(cache), ports, plan, settings, setup),
                                 nprocs=processes, join=False, start_method="spawn")
    join_or_fail(workers, deadline_s)
    return out


def join_or_fail(workers, deadline_s: float) -> None:
    """Wait for spawned ``workers``; a failed one raises (and stops the others), a slow one fails the test."""
    deadline = time.monotonic() + deadline_s
    while not workers.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"dist workers still running after {deadline_s} s")


def written(run_dir: Path):
    """A run's metrics rows and exported weights."""
    from safetensors.torch import load_file
    return read_jsonl(run_dir / "metrics.jsonl"), load_file(run_dir / "checkpoint" / "model.safetensors")


def assert_keeps_first_rows(case_dir: Path, rows: list) -> tuple[list, list]:
    """A resumed case's ``rows`` begin with its first run's rows up to the checkpoint and are as many as
    that run's; its first run's rows and the kept ones."""
    first = read_jsonl(case_dir / "first-metrics.jsonl")
    kept = [row for row in first if row["step"] <= 2]
    assert rows[:len(kept)] == kept and len(rows) == len(first)
    return first, kept
