"""Recovery: what a receiver does with what arrived, and what a sender does about what did not.

One policy per network (``recovery`` in ``NetworkSpec``; docs/semantics.md compares them):

- ``zero``: a lost packet contributes nothing (``algorithms.combine``, applied by ``delivery``).
- ``rescale``: what arrives is divided by the probability that it arrives, hop by hop: an unbiased
  sum.
- ``hadamard``, ``hadamard+rescale``: every sender applies a randomized Hadamard transform (random
  signs, then an orthonormal Walsh-Hadamard transform over blocks of ``hadamard_block`` elements)
  to its contribution; the collective runs on the transformed messages with ``zero`` or
  ``rescale``, and every receiver inverts the transform. The transform is linear and the same on
  every rank, so it commutes with the sum: it sits once around the whole collective, whatever the
  algorithm. A lost packet becomes small noise spread over its block instead of a hole. The signs
  come from a stream keyed by (seed, call site, direction), drawn afresh every call.
- ``outliers``, ``outliers+hadamard``: every sender takes the ``outlier_fraction`` of its own
  contribution's elements of largest magnitude out of the message (zeros travel in their place) and
  sends them as (index, value) pairs by a reliable all-gather on a side path; the rest goes under
  ``zero`` (or ``hadamard``), and every receiver adds every rank's pairs to what arrived. The side
  path is real traffic: the network charges it as a retransmitted all-gather (``side_bytes``).
- ``stale``: a lost packet of a send is replaced by the last values that arrived on that send
  (the same step, link and packets of this call site and direction); nothing yet: zero.
- ``drop_token``: on an all-to-all (an expert's dispatch or combine), a row (one token's vector for one
  expert) with any lost packet is lost whole: the expert skips the token, as one over its capacity; on
  every other collective it is ``zero``.
- ``error_feedback``: a sender keeps what a send failed to deliver and adds it to what that send
  carries at the next call of the call site, so the sum over calls is conserved at every receiver.
  It feeds gradients back: on activations (direction ``fwd``) it is ``zero``.
- ``mask``: ``zero``'s holes, known to the receiver: context parallelism's attention leaves a key or
  value a lost packet touched out of the softmax (``lossysim.cp``); everywhere else it is ``zero``.

``zero``, ``rescale`` and the Hadamard policies act on what a whole collective delivers (its
``Delivery``); ``stale`` and ``error_feedback`` act on every send, so they run the schedule send by
send (``delivery.send_by_send``). What a policy keeps between calls (signs' stream, per-send
buffers) is a call site's ``Memory``, saved with the network. The compute a policy adds to a
collective is counted in FLOPs (``flops``); the network charges them at the compute model's rate.

A point-to-point send (``LossyNetwork.send``: one sender, one receiver, the whole message) is the
one-hop case of the same rules (``Policy.send``): ``zero`` leaves holes; ``rescale`` divides what
arrives by the probability that it arrives, so every element is an unbiased estimate of the message
(dropout's inverted scaling: with one sender there is no sum, but the rule is the one every hop of a
collective follows); the Hadamard policies transform the message before it leaves and invert it at
the receiver; ``stale`` fills a lost packet with what last arrived at the same place on that link at
that call site; ``error_feedback`` has the sender add what the link failed to deliver at the site's
previous call (gradients only). The ``outliers`` policies do not act on a send (their side path is an
all-gather beside an all-reduce): ``acts_on_sends``, ``SEND_POLICIES``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import delivery as deliver
from .algorithms import Delivery, Schedule, combine
from .sparse import Losses
from ..util import one_of, stream_seed

RECOVERY_POLICIES = ("zero", "rescale", "hadamard", "hadamard+rescale", "stale", "error_feedback", "outliers",
                     "outliers+hadamard", "drop_token", "mask")
ACTIVATIONS = "fwd"            # the direction whose values are never summed again later
DEFAULT_HADAMARD_BLOCK = 1 << 14
DEFAULT_OUTLIER_FRACTION = 1e-3
INDEX_BYTES = 4                # an outlier's index on the side path: int32


def check_block(block: int) -> int:
    """``block`` as an int, or ValueError unless it is a power of two >= 2."""
    value = int(block)
    if value != block or value < 2 or value & (value - 1):
        raise ValueError(f"hadamard_block={block} must be a power of two >= 2 (e.g. {DEFAULT_HADAMARD_BLOCK})")
    return value


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float, or ValueError unless it is in (0, 0.5]."""
    value = float(fraction)
    if not 0.0 < value <= 0.5:
        raise ValueError(f"outlier_fraction={fraction} must be in (0, 0.5] (e.g. {DEFAULT_OUTLIER_FRACTION})")
    return value


def policy(name: str, hadamard_block: int = DEFAULT_HADAMARD_BLOCK,
           outlier_fraction: float = DEFAULT_OUTLIER_FRACTION) -> "Policy":
    """The policy called ``name`` (one of RECOVERY_POLICIES)."""
    if name not in RECOVERY_POLICIES:
        raise ValueError(f"recovery={name!r} must be one of {', '.join(RECOVERY_POLICIES)}")
    if name.startswith("outliers"):
        inner = Hadamard(ZERO, hadamard_block) if name.endswith("+hadamard") else ZERO
        return Outliers(inner, outlier_fraction)
    if name.startswith("hadamard"):
        return Hadamard(RESCALE if name.endswith("+rescale") else ZERO, hadamard_block)
    return {"zero": ZERO, "rescale": RESCALE, "stale": STALE, "error_feedback": ERROR_FEEDBACK,
            "drop_token": DROP_TOKEN, "mask": MASK}[name]


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


# -- the policies ----------------------------------------------------------------------------------
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


class Rescale(Policy):
    """What arrives, divided by the probability that it arrives."""
    name = "rescale"
    rescale = True
    acts_on_exchanges = False   # (an all-to-all's rows are no sum to keep unbiased; not modelled)
    acts_on_keys = False    # all-gathered keys are no sums (zeros where lost): the ring's would differ from them


class DropToken(Policy):
    """An all-to-all's row (one token's vector for one expert: a message's last dimension) with any lost
    packet is lost whole. Dispatch: the expert skips the token, as it skips one over its capacity;
    combine: the token gets nothing from that expert; backward: the row's gradient is zero. On every
    other collective it is ``zero``."""
    name = "drop_token"
    drops_rows = True
    only_on = "all_to_all"
    acts_on_keys = False    # (experts beside context parallelism are refused: config._validate_pairs)


class Mask(Policy):
    """``zero``'s holes, and a receiver that knows where they are: context parallelism's attention leaves a key
    whose packet was lost out of the softmax of the queries that would have read it (``lossysim.cp``). On
    every other message (all-reduces, pipeline sends, gradients) there is no softmax to leave it out of: it
    is ``zero``."""
    name = "mask"
    masks_keys = True
    acts_on_exchanges = False   # (it needs cp_size > 1, and experts beside context parallelism are refused)


ZERO, RESCALE, DROP_TOKEN, MASK = Policy(), Rescale(), DropToken(), Mask()


# -- Hadamard ----------------------------------------------------------------------------------------
def blocks(n: int, block: int) -> list[tuple[int, int, int]]:
    """How ``n`` elements are cut into transform blocks: ``(start, count, size)``, ``count`` blocks of
    ``size`` elements from ``start``: whole blocks, then the binary digits of the remainder, largest
    first (1000 elements with block 256: 3 x 256, 128, 64, 32, 8)."""
    whole = n // block
    out = [(0, whole, block)] if whole else []
    start = whole * block
    size = block // 2
    while start < n:
        if n - start >= size:
            out.append((start, 1, size))
            start += size
        size //= 2
    return out


def walsh_hadamard(y: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of the last dim (a power of two), its own inverse.

    A butterfly per bit, by reshapes, two bits per pass: a pass combines the four quarters of the
    last dim (its top two bits) and interleaves the results, which moves the bits it transformed to
    the bottom; once every bit has had its turn each is back in place. Every element is computed
    by the same additions whatever the leading dims, so one receiver alone gets the bits of the
    simulator's row."""
    size = y.shape[-1]
    bits = size.bit_length() - 1
    buffers = [torch.empty_like(y) for _ in range(min((bits + 1) // 2, 2))]
    src = y
    for k in range((bits + 1) // 2):
        dst = buffers[k % 2]
        if bits - 2 * k == 1:              # an odd bit left: one butterfly
            a, b = src.unflatten(-1, (2, size // 2)).unbind(-2)
            out = dst.unflatten(-1, (size // 2, 2))
            torch.add(a, b, out=out[..., 0])
            torch.sub(a, b, out=out[..., 1])
        else:
            a, b, c, d = src.unflatten(-1, (4, size // 4)).unbind(-2)
            top_sum, top_diff, low_sum, low_diff = a + c, a - c, b + d, b - d
            out = dst.unflatten(-1, (size // 4, 4))
            torch.add(top_sum, low_sum, out=out[..., 0])
            torch.sub(top_sum, low_sum, out=out[..., 1])
            torch.add(top_diff, low_diff, out=out[..., 2])
            torch.sub(top_diff, low_diff, out=out[..., 3])
        src = dst
    return src * size ** -0.5


def _by_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``walsh_hadamard`` of every block of the last dim of ``x`` (``blocks``)."""
    out = torch.empty_like(x)
    for start, count, size in blocks(x.shape[-1], block):
        end = start + count * size
        out[..., start:end] = walsh_hadamard(x[..., start:end].unflatten(-1, (count, size))).flatten(-2)
    return out


def _signs(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """+1 or -1 per bit (1: -1)."""
    return 1 - 2 * bits.to(dtype)


def transform(x: torch.Tensor, bits: torch.Tensor, block: int) -> torch.Tensor:
    """H D x: random signs (``bits``: 1 flips), then the blockwise transform, on the last dim."""
    return _by_blocks(x * _signs(bits, x.dtype), block)


def inverse(y: torch.Tensor, bits: torch.Tensor, block: int) -> torch.Tensor:
    """D H y: the inverse of ``transform`` (H and D are their own inverses)."""
    return _by_blocks(y, block).mul_(_signs(bits, y.dtype))


def hadamard_flops(n: int, block: int) -> float:
    """One transform of ``n`` elements: a sign and a scale per element, an addition per element and bit."""
    return float(sum(count * size * (math.log2(size) + 2) for _, count, size in blocks(n, block)))


@dataclass
class Transformed:
    """A draw of a Hadamard policy: what arrives (of the transformed messages) and this call's signs."""
    delivery: Delivery
    bits: torch.Tensor


def packets_of(drawn) -> Delivery:
    """What arrived packet by packet, before a policy filled or transformed anything (a Delivery for any
    policy's draw): which elements a loss touched, whatever the policy then makes of them."""
    if isinstance(drawn, Transformed):
        return drawn.delivery
    if isinstance(drawn, Hops):
        return combine(drawn.sched, drawn.lost, None)
    return drawn


class Hadamard(Policy):
    """The randomized Hadamard transform around the collective, ``inner`` (zero or rescale) inside."""
    keeps_memory = True
    computes = True
    acts_on_shards = False   # the inverse transform needs the whole sum
    acts_on_exchanges = False
    acts_on_keys = False     # its noise spreads over the block: no receiver can tell which keys it spoilt
    settings = ("hadamard_block",)

    def __init__(self, inner: Policy, block: int):
        self.inner, self.block = inner, check_block(block)
        self.name = "hadamard" + ("+rescale" if inner.rescale else "")
        self.rescale = inner.rescale

    def draw(self, transfer, lost, collective, numel, dtype, memory):
        delivery = self.inner.draw(transfer, lost, collective, numel, dtype, memory)
        if collective not in ("all_reduce", "send"):
            return delivery          # a gathered shard is not a sum: holes stay zeros
        return Transformed(delivery, memory.signs(numel))

    def all_reduce(self, drawn, x, receivers, per_packet, watch, memory, update, out=None):
        work = torch.promote_types(x.dtype, torch.float32)
        sent = transform(x.to(work), drawn.bits, self.block).to(x.dtype)   # what the wire carries
        held = self.inner.all_reduce(drawn.delivery, sent, receivers, per_packet, lambda seen: None, memory, update)
        held = inverse(held.to(work), drawn.bits, self.block).to(x.dtype)
        watch(held)
        return deliver.into(out, held)

    def send(self, drawn, x, per_packet, watch, memory, update):
        work = torch.promote_types(x.dtype, torch.float32)
        sent = transform(x.to(work), drawn.bits, self.block).to(x.dtype)
        held = self.inner.send(drawn.delivery, sent, per_packet, lambda seen: None, memory, update)
        held = inverse(held.to(work), drawn.bits, self.block).to(x.dtype)
        watch(held)
        return held

    def flops(self, sched, per_packet, numel):
        return 2 * hadamard_flops(numel, self.block)   # the sender's transform, the receiver's inverse


# -- outliers: the largest elements of each contribution over a reliable side path ------------------
def outlier_count(numel: int, fraction: float) -> int:
    """k = ceil(fraction x numel) elements, at least one, at most all (rounded to 9 digits first, so a
    product such as 0.1 x 30 is 3, not 4)."""
    return min(int(numel), max(1, math.ceil(round(fraction * numel, 9))))


class Outliers(Policy):
    """Each sender's k largest elements (by magnitude, its own: no agreement between ranks) leave the
    lossy message, zeroed in place (the message keeps its size, packets and masks), and travel as
    (index, value) pairs on a reliable side path; ``inner`` (zero or hadamard) recovers the rest, and
    every receiver adds every rank's pairs to it. LLM.int8's outliers kept apart, on the wire."""
    computes = True
    side_path = True
    acts_on_shards = False   # every receiver adds every rank's outliers to the whole sum
    acts_on_exchanges = False
    acts_on_sends = False    # the side path is an all-gather beside an all-reduce
    acts_on_keys = False     # its side path rides an all-reduce: a key/value exchange has none

    def __init__(self, inner: Policy, fraction: float):
        self.inner, self.fraction = inner, check_fraction(fraction)
        self.settings = inner.settings + ("outlier_fraction",)
        self.name = "outliers" + ("+hadamard" if isinstance(inner, Hadamard) else "")
        self.keeps_memory = inner.keeps_memory

    def draw(self, transfer, lost, collective, numel, dtype, memory):
        return self.inner.draw(transfer, lost, collective, numel, dtype, memory)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index, value) of every rank's k largest elements (``[ranks, k]`` each) and the messages
        without them (zeros in their place)."""
        index = x.abs().topk(outlier_count(x.shape[1], self.fraction), dim=1).indices
        return index, x.gather(1, index), x.scatter(1, index, 0)

    def all_reduce(self, drawn, x, receivers, per_packet, watch, memory, update, out=None):
        index, values, rest = self.split(x)
        held = self.inner.all_reduce(drawn, rest, receivers, per_packet, lambda seen: None, memory, update).clone()
        for r in range(x.shape[0]):   # rank by rank, in rank order: the same bits at every receiver
            held.index_add_(1, index[r], values[r].expand(len(receivers), -1))
        watch(held)
        return deliver.into(out, held)

    def flops(self, sched, per_packet, numel):
        # the sender's selection (a magnitude and a comparison per element) and zeroing (k), the
        # receiver's scatter-add of every rank's k values
        k = outlier_count(numel, self.fraction)
        return 2.0 * numel + k + sched.ranks * k + self.inner.flops(sched, per_packet, numel)

    def side_bytes(self, numel, dtype):
        # k pairs, packed: an int32 index and a value in the message's dtype
        return outlier_count(numel, self.fraction) * (INDEX_BYTES + dtype.itemsize)


# -- send by send: stale and error feedback ----------------------------------------------------------
@dataclass
class Hops:
    """A draw of a send-by-send policy: the schedule, the lost packets of every send, and which
    message size's buffers apply."""
    sched: Schedule
    lost: torch.Tensor          # [sends, max_packets]
    key: str
    held: Optional[torch.Tensor] = None   # what every rank held after the call, for a replay


def _elements(sched: Schedule, per_packet: int, numel: int, end: str) -> int:
    """The most elements one rank sends (``end="src"``) or receives (``"dst"``) in the schedule."""
    count = [0] * sched.ranks
    for s in sched.sends:
        count[getattr(s, end)] += max(0, min(numel, (s.first + s.packets) * per_packet) - s.first * per_packet)
    return max(count, default=0)


class SendBySend(Policy):
    """A policy acting on every send: ``arrive`` says what a round's receivers take."""
    keeps_memory = True
    computes = True
    send_by_send = True
    acts_on_shards = False   # its all-reduce replays every hop of the ring
    acts_on_exchanges = False
    acts_on_keys = False     # what it keeps between calls is not a receiver's gaps
    buffers: tuple[str, ...] = ()   # per-send buffers, one payload each, zeros until written
    remembers = False               # a replay returns what the call delivered (it cannot recompute it)

    def draw(self, transfer, lost, collective, numel, dtype, memory):
        if collective not in ("all_reduce", "send"):
            return super().draw(transfer, lost, collective, numel, dtype, memory)
        mask = lost.mask() if isinstance(lost, Losses) else lost
        key = f"{numel}:{str(dtype).removeprefix('torch.')}"
        if collective == "send":   # each link's messages keep their own buffers
            key = "send{}>{}:{}".format(*transfer.sched.pair, key)
        return Hops(transfer.sched, mask, key)

    def all_reduce(self, drawn, x, receivers, per_packet, watch, memory, update, out=None):
        sched = drawn.sched

        def fresh() -> dict:
            shape = (len(sched.sends), sched.max_packets, per_packet)
            return {name: torch.zeros(shape, dtype=x.dtype, device=x.device) for name in self.buffers}

        state = memory.sends(drawn.key, fresh)
        held = None if update else drawn.held
        if held is None:
            held = deliver.send_by_send(x, sched, drawn.lost, per_packet,
                                        lambda hop, payload, lost: self.arrive(state, hop, payload, lost, update))
            if self.remembers:
                drawn.held = held
        held = held[list(receivers)]
        watch(held)
        return deliver.into(out, held)

    def send(self, drawn, x, per_packet, watch, memory, update):
        n, n_packets = x.numel(), drawn.sched.n_packets
        state = memory.sends(drawn.key, lambda: {name: x.new_zeros(1, n_packets, per_packet)
                                                 for name in self.buffers})
        held = None if update else drawn.held
        if held is None:
            payload = x.new_zeros(n_packets * per_packet)
            payload[:n] = x
            taken = self.arrive(state, _whole(n_packets, x.device), payload.view(1, n_packets, per_packet),
                                drawn.lost[:, :n_packets], update)
            held = taken.reshape(-1)[:n]
            if self.remembers:
                drawn.held = held
        watch(held)
        return held

    def arrive(self, state: dict, hop: deliver.Round, payload: torch.Tensor, lost: torch.Tensor,
               update: bool) -> torch.Tensor:
        raise NotImplementedError


class Stale(SendBySend):
    """A lost packet of a send takes the last values that arrived on that send; nothing yet: zero.
    The receiver keeps one buffer per send it receives (``last``: zeros until a packet arrives, and
    zeros on padding, which never arrives)."""
    name = "stale"
    buffers = ("last",)

    def arrive(self, state, hop, payload, lost, update):
        width = payload.shape[1]
        taken = torch.where((hop.valid & ~lost).unsqueeze(-1), payload, state["last"][hop.sends, :width])
        if update:
            state["last"][hop.sends, :width] = taken
        return taken

    def flops(self, sched, per_packet, numel):
        return 2.0 * _elements(sched, per_packet, numel, "dst")   # choose, and keep, what arrived


class ErrorFeedback(SendBySend):
    """A send carries what it failed to deliver at the call site's previous call (``owed``) on top of
    its payload; what it fails to deliver now is owed next time. Gradients only: on activations it is
    ``zero``."""
    name = "error_feedback"
    buffers = ("owed",)
    remembers = True    # the call moved what is owed on: replaying it must not add it again
    on_activations = False

    def arrive(self, state, hop, payload, lost, update):
        width = payload.shape[1]
        payload = payload + state["owed"][hop.sends, :width]
        if update:
            state["owed"][hop.sends, :width] = torch.where(lost.unsqueeze(-1), payload, 0)
        return torch.where((hop.valid & ~lost).unsqueeze(-1), payload, 0)

    def flops(self, sched, per_packet, numel):
        return 2.0 * _elements(sched, per_packet, numel, "src")   # add what is owed, keep what is lost


STALE, ERROR_FEEDBACK = Stale(), ErrorFeedback()


@functools.lru_cache(maxsize=64)
def _whole(n_packets: int, device: torch.device) -> deliver.Round:
    """A send as one round: its only send, every packet of it (no padding); ``arrive`` reads no ranks."""
    column = torch.zeros(1, 1, dtype=torch.long, device=device)
    return deliver.Round(torch.zeros(1, dtype=torch.long, device=device), column, column,
                         torch.arange(n_packets, device=device).unsqueeze(0),
                         torch.ones(1, n_packets, dtype=torch.bool, device=device), adds=False)


# The policies that act on a reduce-scatter: what FSDP's sharded gradients can use.
SHARD_POLICIES = tuple(name for name in RECOVERY_POLICIES if policy(name).acts_on_shards)
# The policies that act on a point-to-point send: what pipeline stages' messages can use.
SEND_POLICIES = tuple(name for name in RECOVERY_POLICIES if policy(name).acts_on_sends)
# The policies that act on an all-to-all: what an MoE's dispatch and combine can use.
EXCHANGE_POLICIES = tuple(name for name in RECOVERY_POLICIES if policy(name).acts_on_exchanges)
# The policies that act on context parallelism's key/value exchange (``lossysim.cp``).
KV_POLICIES = tuple(name for name in RECOVERY_POLICIES if policy(name).acts_on_keys)


def require(name: str, collective: str, used: bool = True, works: Callable[[str], bool] = lambda name: True) -> None:
    """The one rule of what a policy acts on, for the network (a Python caller) and the config (a run's
    layout) alike: ``collective`` ``send`` (pipeline stages' point-to-point sends), ``reduce_scatter``
    (FSDP's sharded gradients), ``all_to_all`` (an MoE's dispatch and combine) or ``kv_exchange`` (context
    parallelism's keys and values, by sends or an all-gather). ``used``: whether the run has that
    collective; a policy that acts on it alone (``only_on``) needs it. A one-line ValueError naming the
    policies that do and that ``works`` accepts (the config's: the run's other settings accept them; all
    that act when none does, as another setting is wrong too)."""
    acts, what = {"send": (SEND_POLICIES, "point-to-point sends"),
                  "reduce_scatter": (SHARD_POLICIES, "reduce-scatters"),
                  "all_to_all": (EXCHANGE_POLICIES, "all-to-alls"),
                  "kv_exchange": (KV_POLICIES, "key/value exchanges")}[collective]
    if used and name not in acts:
        working = tuple(policy for policy in acts if works(policy)) or acts
        raise ValueError(f"recovery={name} does not act on {what}: use "
                         f"{one_of(working) if len(working) > 1 else working[0]}")
    if not used and policy(name).only_on == collective:
        raise ValueError(f"recovery={name} acts on {what} only (elsewhere it is zero), and the run has none")
