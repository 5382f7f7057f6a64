"""What every recovery policy is: what a call site keeps between calls (``Memory``), the protocol a
policy follows and ``zero``, the base every policy builds on (``Policy``), and what each declares it
acts on, one flag per kind of message (``KINDS`` names the kinds ``registry.require`` checks).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import delivery as deliver
from ..algorithms import Schedule
from ..receivers import combine
from ..sparse import Losses
from ...util import stream_seed

ACTIVATIONS = "fwd"            # the direction whose values are never summed again later

# The kinds of message a policy may not act on, each with the ``Policy`` flag that says whether it does
# and the words a refusal names it by (``registry.require``): every such declaration is in this module.
KINDS = {"send": ("acts_on_sends", "point-to-point sends"),
         "reduce_scatter": ("acts_on_shards", "reduce-scatters"),
         "all_to_all": ("acts_on_exchanges", "all-to-alls"),
         "kv_exchange": ("acts_on_keys", "key/value exchanges")}


# -- what a policy keeps at a call site ------------------------------------------------------------
class Memory:
    """What a policy keeps at one call site and direction between calls: the stream of the Hadamard
    signs, and per message size the buffers of every send (``sends``)."""

    def __init__(self, seed: int, site: str, direction: str, device):
        self.device = torch.device(device)
        self._seed = stream_seed(seed, site, direction + "/recovery")
        self._generator: Optional[torch.Generator] = None
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(self._seed)
        return self._generator

    def signs(self, numel: int) -> torch.Tensor:
        """The next ``numel`` random signs, as bits (1: negative)."""
        return torch.randint(0, 2, (numel,), generator=self.generator, device=self.device, dtype=torch.uint8)

    def sends(self, key: str, make: Callable[[], dict]) -> dict:
        """The per-send buffers of messages of one size (``make``: fresh ones, for the first call)."""
        found = self.buffers.get(key)
        if found is None:
            found = self.buffers[key] = make()
        return found

    def state_dict(self) -> dict:
        return {"generator": None if self._generator is None else self._generator.get_state(),
                "buffers": {key: {name: t.cpu().clone() for name, t in values.items()}
                            for key, values in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._generator = None
        if state["generator"] is not None:
            self.generator.set_state(state["generator"])
        self.buffers = {key: {name: t.to(self.device) for name, t in values.items()}
                        for key, values in state["buffers"].items()}


# -- the policy: its protocol, and zero ------------------------------------------------------------
Watch = Callable[[torch.Tensor], None]


class Policy:
    """``zero``: a lost packet contributes nothing. The base of every policy: ``draw`` says what arrived
    (called once per lossy collective, before activation checkpointing records it), ``all_reduce``
    applies it to the contributions, ``flops`` is the compute it adds per rank and call."""
    name = "zero"
    rescale = False
    keeps_memory = False    # needs a Memory per call site
    computes = False        # adds compute to a collective
    side_path = False       # sends part of a message reliably beside it (``side_bytes``)
    send_by_send = False    # acts on every send as it arrives (needs every send's lost packets, not a Delivery)
    acts_on_shards = True   # acts on a reduce-scatter (FSDP's gradients): needs no whole sum at every rank
    acts_on_sends = True    # acts on a point-to-point send (pipeline stages' activations and gradients)
    on_activations = True   # acts on activations (else ``on(ACTIVATIONS)`` is zero)
    drops_rows = False      # an all-to-all's row (its last dimension) with a lost packet is lost whole
    acts_on_exchanges = True  # acts on an all-to-all (an MoE's dispatch and combine): a hole, or the row it hit
    acts_on_keys = True     # acts on context parallelism's keys and values: holes a receiver sees (``net/gaps.py``)
    masks_keys = False      # a context-parallel receiver leaves keys it lost out of attention (``mask``)
    only_on: Optional[str] = None   # the one collective it acts on (elsewhere it is ``zero``): a run needs it
    settings: tuple[str, ...] = ()   # the NetworkSpec settings it reads beside ``recovery``

    def on(self, direction: str) -> "Policy":
        """The policy that applies to traffic in ``direction``."""
        return self if self.on_activations or direction != ACTIVATIONS else ZERO

    def draw(self, transfer, lost: torch.Tensor, collective: str, numel: int, dtype: torch.dtype,
             memory: Optional[Memory]):
        """What arrives where, given the lost packets of each send (``[sends, max_packets]``, or their
        positions: ``sparse.Losses``); ``rescale`` weighs every delivered path by the product of its hops'
        1 / P(delivery)."""
        weights = None
        if self.rescale and collective in ("all_reduce", "reduce_scatter", "send"):
            weights = transfer.weights(torch.promote_types(dtype, torch.float32))
        if isinstance(lost, Losses):
            return lost.delivery(weights)
        return combine(transfer.sched, lost, weights)

    def all_reduce(self, drawn, x: torch.Tensor, receivers: Sequence[int], per_packet: int, watch: Watch,
                   memory: Optional[Memory], update: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What each receiver holds, ``[len(receivers), n]``, given ``x`` ([ranks, n]) and what ``draw``
        drew; ``update``: move the memory on (False when a recomputed forward replays a call); ``out``:
        where to write it (may be ``x`` itself: in place)."""
        return deliver.all_reduce(x, drawn, receivers, per_packet, rescale=self.rescale, watch=watch, out=out)

    def send(self, drawn, x: torch.Tensor, per_packet: int, watch: Watch, memory: Optional[Memory],
             update: bool) -> torch.Tensor:
        """What the receiver of a send of ``x`` ([n]) holds, ``[n]``, given what ``draw`` drew (its
        packets, weighted by ``rescale``'s 1 / P(delivery); lost ones zero); ``watch``, ``memory`` and
        ``update`` as ``all_reduce`` takes them."""
        held = deliver.direct_sum(x.unsqueeze(0), drawn.weights, per_packet, dense=x.device.type == "cuda")[0]
        watch(held)
        return held

    def flops(self, sched: Schedule, per_packet: int, numel: int) -> float:
        """Floating-point operations a rank adds to one all-reduce (or send) of ``numel`` elements."""
        return 0.0

    def side_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes each rank sends on a reliable side path (an all-gather) beside one all-reduce of
        ``numel`` elements of ``dtype``; 0: no side path."""
        return 0

    def __repr__(self) -> str:
        return f"recovery={self.name}"


ZERO = Policy()
