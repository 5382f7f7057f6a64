"""Launch torchrun from tests in its own session, so a timeout kills every rank it started."""
import os
import signal
import subprocess
import sys


def torchrun(args, timeout=300, nproc=2, **popen):
    """Run ``torchrun --standalone --nproc_per_node=N -m lossysim ARGS``; CompletedProcess-like."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "lossysim", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun timed out after {timeout}s: {err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stat(pid: int):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])  # state, parent pid


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    left = []
    for pid in pids:
        try:
            if _stat(pid)[0] != "Z":
                left.append(pid)
        except OSError:
            pass
    return left


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = _stat(int(entry))[1]
            except OSError:
                pass
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return alive(found)


def rank_pids(root: int, rank: int) -> list[int]:
    """Processes below ``root`` whose environment says they are this torchrun rank."""
    found = []
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and f"LOCAL_RANK={rank}".encode() in env:
            found.append(pid)
    return found
