"""Where a run's process stands: torchrun's environment, its device, and how it dies with its parent."""
from __future__ import annotations

import ctypes
import os
import signal
from datetime import timedelta
from typing import Optional


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies (even by SIGKILL), so no process is left orphaned.

    Called by every dist rank (its parent is torchrun) and, as a ``preexec_fn``, by every
    torchrun a sweep starts (its parent is the sweep)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment, with a clear error outside it."""
    import torch
    import torch.distributed as dist
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"backend 'dist' must be launched by torchrun (missing {', '.join(missing)}); "
                         "e.g. torchrun --nproc_per_node=2 -m lossysim train --backend dist ...")
    die_with_parent()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs = {}
        if backend == "nccl":
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


def device(name: str):
    """The torch device a ``device`` config value names (``auto``: CUDA when there is one)."""
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found = torch.device(name)
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return found
