"""Running a sim run's replicas side by side, one at a time, so that their experts can meet.

An expert-parallel group's all-to-all needs every member's tokens at once, but ``sim`` holds every
replica in one process, each with its own model. ``Lockstep.run`` runs one task per replica (its
forward and backward passes) in a thread of its own, and only one thread runs at any moment: a thread
runs until it reaches a meeting (``meet``: an all-to-all, or the routing's counts), then hands the
turn to the next replica that can run. The last member to arrive does the meeting's work (the network
call, over every member's data) and runs on; the others run again, each with its share of the
result, when the turn comes back to them. The threads run in a fixed order, so a run's bits do not
depend on the operating system's scheduler: the same as one replica after another, but with their
meetings in step. On CPU autograd runs a backward pass on the thread that calls it, so backward
meetings work the same way (a CUDA backward runs on the device's own thread: ``sim`` experts train on
CPU; ``dist`` runs them anywhere).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable, Sequence


class LockstepError(RuntimeError):
    """The replicas stopped meeting: a member never came (a bug), or another replica failed."""


class Lockstep:
    """One thread per task, one running at a time; ``meet`` joins the tasks' calls of one key."""

    def __init__(self):
        self._cv = threading.Condition()
        self._local = threading.local()
        self._running = False

    @property
    def active(self) -> bool:
        """Whether the calling thread is one of a ``run``'s tasks (else ``meet`` has no one to meet)."""
        return getattr(self._local, "index", None) is not None

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list:
        """Every task's result, in order; the first error any task raised, raised again here."""
        if self._running:
            raise RuntimeError("Lockstep.run is not reentrant")
        n = len(tasks)
        self._running, self._turn, self._aborted = True, 0, None
        self._state = ["ready"] * n
        self._meetings: dict = {}
        self._calls: dict = defaultdict(int)
        results: list = [None] * n
        errors: list = []

        def work(i: int) -> None:
            self._local.index = i
            try:
                with self._cv:
                    self._cv.wait_for(lambda: self._turn == i or self._aborted is not None)
                    if self._aborted is not None:
                        return
                results[i] = tasks[i]()
            except BaseException as err:   # noqa: BLE001 (re-raised in the caller's thread)
                with self._cv:
                    errors.append(err)
                    self._aborted = self._aborted or err
            finally:
                self._local.index = None
                with self._cv:
                    self._state[i] = "done"
                    self._hand_on(i)
                    self._cv.notify_all()

        threads = [threading.Thread(target=work, args=(i,), name=f"lossysim-replica{i}", daemon=True)
                   for i in range(n)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            self._running = False
        if errors:
            first = next((e for e in errors if not isinstance(e, LockstepError)), errors[0])
            raise first
        return results

    def meet(self, key, members: int, member: int, payload, work: Callable[[list], list]):
        """Member ``member`` of ``members`` brings ``payload`` to the next meeting of ``key``; the last to
        come calls ``work`` on every member's payload (in member order) and each gets its entry of the
        list it returns."""
        i = self._local.index
        with self._cv:
            call = self._calls[(key, member)]
            self._calls[(key, member)] += 1
            meeting = self._meetings.setdefault((key, call), {"payloads": {}, "waiting": [], "result": None,
                                                              "taken": 0})
            meeting["payloads"][member] = payload
            if len(meeting["payloads"]) == members:
                meeting["result"] = work([meeting["payloads"][m] for m in range(members)])
                for j in meeting["waiting"]:
                    self._state[j] = "ready"
            else:
                meeting["waiting"].append(i)
                self._state[i] = "waiting"
                self._hand_on(i)
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == i or self._aborted is not None)
                if self._aborted is not None:
                    raise LockstepError(f"replica {i} stopped waiting at {key!r}: {self._aborted}")
            result = meeting["result"][member]
            meeting["taken"] += 1
            if meeting["taken"] == members:
                del self._meetings[(key, call)]
            return result

    def _hand_on(self, i: int) -> None:
        """(Holding the lock) the turn to the next ready task after ``i``; none ready while some still wait
        is a meeting that can never happen."""
        n = len(self._state)
        for step in range(1, n + 1):
            j = (i + step) % n
            if self._state[j] == "ready":
                self._turn = j
                return
        self._turn = None
        if any(state == "waiting" for state in self._state) and self._aborted is None:
            self._aborted = LockstepError("replicas wait at meetings no other replica will come to")


def solo(members: int, member: int, payload, work: Callable[[list], list], others: Callable[[int], Any]):
    """A meeting outside ``Lockstep.run`` (evaluation: one replica runs): the other members bring
    ``others(m)``."""
    payloads = [payload if m == member else others(m) for m in range(members)]
    return work(payloads)[member]
