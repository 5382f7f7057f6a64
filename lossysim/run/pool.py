"""A sweep's runs side by side (``--jobs N``): N worker processes, each running one run at a time on its config's
``threads``, fed in grid order as they finish.

A run computes in a process of its own, seeded by its own config, so what it writes never depends on what runs
beside it (tests/test_sweep_jobs.py holds it to that). Workers are fresh interpreters (``spawn``), not forks: the
sweep has already used torch (its checks build models on the meta device) and a fork does not carry torch's
thread pools over safely. Each worker imports torch once and runs many runs.

``Inline`` is the same interface for one job, in this process: a trainer handed to the sweep (tests hand it
stand-ins) can only run where it was handed.
"""
from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
from typing import Callable, Optional

from ..config.execution import check_count
from .names import Run


def check_jobs(jobs) -> int:
    return check_count("jobs", jobs)


class Inline:
    """One run at a time, in this process: ``execute(run)`` returns the run's status."""

    def __init__(self, execute: Callable[[Run], Optional[str]]):
        self._execute, self._queued = execute, []

    @property
    def pending(self) -> int:
        return len(self._queued)

    def submit(self, index: int, run: Run) -> None:
        self._queued.append((index, run))

    def next_done(self) -> tuple[int, Optional[str]]:
        index, run = self._queued.pop(0)
        return index, self._execute(run)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _work(slot: int, tasks, done, progress: bool, execute: Callable) -> None:
    """A worker's loop; ``execute`` is the sweep's (pickled by name: the worker imports it itself)."""
    from tqdm import tqdm

    from .runtime import die_with_parent
    die_with_parent()
    # tqdm's default lock is a multiprocessing semaphore of this process alone (a spawned worker shares no
    # lock with the sweep): a worker stopped by Ctrl-C would leave it to the resource tracker's warning
    tqdm.set_lock(threading.RLock())
    while True:
        item = tasks.get()
        if item is None:
            return
        index, run = item
        done.put(("started", slot, index))
        status = execute(run, progress=progress, position=slot + 1).get("status")
        done.put(("done", slot, index, status))


class Pool:
    """``jobs`` worker processes; ``submit`` a run, ``next_done`` waits for any run to end: (index, status).
    A worker that dies in a run (killed, out of memory) leaves that run ``failed`` by ``on_lost`` and is
    replaced. Leaving the block by an exception (Ctrl-C) stops every worker at once (SIGTERM); their
    unfinished runs start again on the next sweep, as a killed sweep's do."""

    def __init__(self, jobs: int, progress: bool, on_lost: Callable[[Run, str], None], execute: Callable):
        self._context = multiprocessing.get_context("spawn")
        self._tasks, self._done = self._context.Queue(), self._context.Queue()
        self._progress, self._on_lost, self._execute = progress, on_lost, execute
        self._running: dict[int, tuple[int, Run]] = {}   # slot -> the run it holds
        self._submitted: dict[int, Run] = {}
        self._workers = [self._start(slot) for slot in range(check_jobs(jobs))]

    def _start(self, slot: int):
        worker = self._context.Process(target=_work, args=(slot, self._tasks, self._done, self._progress, self._execute),
                                       name=f"lossysim-sweep-job{slot + 1}", daemon=True)
        # A worker ignores Ctrl-C (its disposition is inherited): the sweep alone answers it, once, and stops
        # every worker, with no traceback from wherever each one was.
        if threading.current_thread() is not threading.main_thread():   # only the main thread sets handlers
            worker.start()
            return worker
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            worker.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        return worker

    @property
    def pending(self) -> int:
        return len(self._submitted)

    def submit(self, index: int, run: Run) -> None:
        self._submitted[index] = run
        self._tasks.put((index, run))

    def next_done(self) -> tuple[int, Optional[str]]:
        while True:
            try:
                message = self._done.get(timeout=1.0)
            except queue.Empty:
                lost = self._lost()
                if lost is not None:
                    return lost
                continue
            if message[0] == "started":
                self._running[message[1]] = (message[2], self._submitted[message[2]])
                continue
            _, slot, index, status = message
            self._running.pop(slot, None)
            self._submitted.pop(index)
            return index, status

    def _lost(self) -> Optional[tuple[int, str]]:
        """A worker that died holding a run: the run failed; a new worker takes the slot."""
        for slot, worker in enumerate(self._workers):
            if worker.is_alive():
                continue
            self._workers[slot] = self._start(slot)
            if slot in self._running:
                index, run = self._running.pop(slot)
                self._submitted.pop(index)
                self._on_lost(run, f"its worker process died (exit code {worker.exitcode})")
                return index, "failed"
        return None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            for _ in self._workers:
                self._tasks.put(None)
            for worker in self._workers:
                worker.join()
        else:
            for worker in self._workers:
                if worker.is_alive():
                    worker.terminate()
            for worker in self._workers:
                worker.join(timeout=10)
        self._tasks.close()
        self._done.close()
        return False
