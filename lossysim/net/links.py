"""Links: where a packet is dropped. One loss chain per directed link, seeded per call site.

Each collective call site (a name such as ``h.3.attn.reduce``) and direction (``fwd``
activations, ``bwd`` gradients) owns a random stream seeded from (seed, site, direction), so the
masks a site draws depend neither on call order elsewhere nor on whether one process simulates
every rank or each rank runs in its own process.
"""
from __future__ import annotations

import hashlib


def stream_seed(seed: int, site: str, direction: str) -> int:
    """A stable 63-bit seed for one (seed, site, direction) random stream."""
    digest = hashlib.blake2b(f"{seed}\0{site}\0{direction}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
