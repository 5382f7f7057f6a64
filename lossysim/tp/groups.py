"""The two backends of a tensor-parallel group: every rank in one process, or one rank per process.

Tensors in the tensor-parallel region carry a leading rank dimension R: all ``tp_size`` ranks
stacked in one process (``SimGroup``), or R = 1 with one rank per process on torch.distributed
(``DistGroup``). The Megatron mappings (``lossysim.tp.mappings``) only see a group; the group
moves data and hands it to the LossyNetwork, which decides what arrives.

Each call site has a stable name (``h.3.attn.copy``, ``h.3.attn.reduce``) that keys its random
stream and statistics.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from ..net import LossyNetwork
from ..util import swapped


class SimGroup:
    """All ranks simulated in one process, stacked along dim 0 (R = tp_size)."""

    backend = "sim"

    def __init__(self, network: LossyNetwork, seed: int = 0):
        self.network = network
        self.tp_size = network.ranks
        self.ranks = list(range(self.tp_size))
        self.rows = 1             # rows of the last forward's [R * batch, ...] (``run_per_rank``)
        self.seed = int(seed)
        self._replicated_rng: dict[torch.device, torch.Generator] = {}
        self._record = None
        self._replay = None

    @property
    def local_size(self) -> int:
        return len(self.ranks)

    @property
    def stacked(self) -> int:
        """Rows blocks of ``[stacked * batch, ...]``, one per rank this process runs: its TP ranks (context
        parallelism's group stacks each TP rank's context ranks too: ``lossysim.cp``)."""
        return self.local_size

    def per_rank(self, shards: torch.Tensor) -> torch.Tensor:
        """A sharded parameter (``[local_size, ...]``) as each stacked rank multiplies by it."""
        return shards

    def replicated_views(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A replicated parameter as each stacked rank's own view (``run_per_rank``): autograd sums the
        views' gradients, rank by rank, as dist's all-reduce adds the ranks' sums."""
        return param.expand(self.stacked, *param.shape).unbind(0)

    def row_bias(self, bias: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """A row-parallel layer's replicated bias as ``[rows, 1, n]`` stacked ranks add it (``RowParallel``)."""
        return bias.to(dtype).expand(rows, 1, -1)

    def all_reduce(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        return self.network.all_reduce(site, direction, x, self.ranks)

    def all_gather(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        """[R, ..., n] -> [R, ..., tp_size * n]: every rank's shard, concatenated along the last dim."""
        gathered = self.network.all_gather(site, direction, x, self.ranks)  # [R, tp, ..., n]
        return torch.cat(gathered.unbind(1), dim=-1)

    def average_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        """Replicated parameters are shared here, so autograd already summed the ranks' grads."""
        return grad / self.tp_size

    def sum_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        """A replicated parameter inside the TP region (each rank's gradient is its heads' part): the sum
        of the ranks', which autograd already took here."""
        return grad

    def all_gather_reliable(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] -> [tp_size, ...] outside the lossy network (measurements, checkpoints)."""
        return x

    # -- replicated randomness (Megatron's RNG tracker) -------------------------
    def replicated_generator(self, device: torch.device) -> torch.Generator:
        """One stream shared by all ranks, so dropout in replicated regions draws one mask."""
        device = torch.device(device)
        gen = self._replicated_rng.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._replicated_rng[device] = gen
        return gen

    def dropout_mask(self, shape, p: float, device, dtype) -> torch.Tensor:
        """A scaled keep-mask from the replicated stream (replayed under recomputation)."""
        if self._replay is not None:
            return self._replay["dropout"].popleft()
        keep = torch.empty(shape, device=device, dtype=dtype)
        keep.bernoulli_(1.0 - p, generator=self.replicated_generator(device)).div_(1.0 - p)
        if self._record is not None:
            self._record["dropout"].append(keep)
        return keep

    def rng_state(self) -> dict:
        return {str(d): g.get_state() for d, g in self._replicated_rng.items()}

    def load_rng_state(self, state: dict) -> None:
        for device, value in state.items():
            self.replicated_generator(torch.device(device)).set_state(value)

    # -- activation checkpointing -------------------------------------------------
    def checkpoint_contexts(self):
        """``context_fn`` for torch.utils.checkpoint: the recomputed forward replays
        the original forward's packet masks and dropout masks, and counts nothing twice."""
        return checkpoint_contexts(self)

    @contextlib.contextmanager
    def recording(self, record):
        with swapped(self, "_record", record), self.network.recording(record):
            yield

    @contextlib.contextmanager
    def replaying(self, record):
        with swapped(self, "_replay", record), self.network.replaying(record):
            yield


def checkpoint_contexts(*parts):
    """``context_fn`` for torch.utils.checkpoint over every part a checkpointed block may call (each
    stage's TP group, the pipeline's boundaries): each records in the forward, in a record of its own,
    and replays it in the recomputed forward (``recording``, ``replaying``)."""
    records = [defaultdict(deque) for _ in parts]

    @contextlib.contextmanager
    def every(method: str):
        with contextlib.ExitStack() as stack:
            for part, record in zip(parts, records):
                stack.enter_context(getattr(part, method)(record))
            yield
    return every("recording"), every("replaying")


class DistGroup(SimGroup):
    """One rank per process on torch.distributed (R = 1).

    Every process draws every link's mask from the same streams as ``SimGroup``
    and keeps its own receiver's row, so rank r applies exactly the masks the
    simulator applies for rank r.
    """

    backend = "dist"

    def __init__(self, network: LossyNetwork, seed: int = 0, process_group=None,
                 sync_replicated: bool = True):
        super().__init__(network, seed)
        if not dist.is_initialized():
            raise RuntimeError("backend 'dist' needs torch.distributed initialised (launch with torchrun)")
        self.process_group = process_group
        world = dist.get_world_size(process_group)
        if world != self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} but the process group has {world} ranks")
        self.rank = dist.get_rank(process_group)
        self.ranks = [self.rank]
        self.sync_replicated = sync_replicated

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.process_group)
        return out

    def all_reduce(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        if self.network.exact(direction, site):  # loss-free or retransmitted: the library moves the data
            self.network.account(site, direction, x[0])
            out = x.clone()
            dist.all_reduce(out, group=self.process_group)
            self.network.watch(site, direction, out[0])
            return out
        return self.network.all_reduce(site, direction, self._gather(x), self.ranks)

    def all_gather(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        gathered = self.network.all_gather(site, direction, self._gather(x), self.ranks)
        return torch.cat(gathered.unbind(1), dim=-1)

    def average_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        # With exact traffic every rank computes the same replicated gradient: nothing to send.
        if not self.sync_replicated or all(self.network.exact(d) for d in ("fwd", "bwd")):
            return grad
        grad = grad.clone()
        dist.all_reduce(grad, group=self.process_group)
        return grad / self.tp_size

    def sum_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()    # every rank holds its heads' part: summed over a reliable channel
        dist.all_reduce(grad, group=self.process_group)
        return grad

    def all_gather_reliable(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(x)


# torch 2.13 renamed all_gather_into_tensor (same signature); older torch has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
