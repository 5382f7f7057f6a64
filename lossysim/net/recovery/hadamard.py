"""``hadamard``, ``hadamard+rescale``: a randomized Hadamard transform around the collective.

Every sender applies random signs, then an orthonormal Walsh-Hadamard transform over blocks of
``hadamard_block`` elements, to its contribution; the collective runs on the transformed messages
with ``zero`` or ``rescale``, and every receiver inverts the transform. The transform is linear and
the same on every rank, so it commutes with the sum: it sits once around the whole collective,
whatever the algorithm. A lost packet becomes small noise spread over its block instead of a hole.
The signs come from a call site's ``Memory`` (keyed by seed, call site and direction), drawn afresh
every call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import delivery as deliver
from ..receivers import Delivery
from .base import Policy

DEFAULT_HADAMARD_BLOCK = 1 << 14


def check_block(block: int) -> int:
    """``block`` as an int, or ValueError unless it is a power of two >= 2."""
    value = int(block)
    if value != block or value < 2 or value & (value - 1):
        raise ValueError(f"hadamard_block={block} must be a power of two >= 2 (e.g. {DEFAULT_HADAMARD_BLOCK})")
    return value


# -- the transform -----------------------------------------------------------------------------------
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


# -- the policy --------------------------------------------------------------------------------------
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
