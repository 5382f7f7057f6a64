"""Which cables lose packets, and how: one named cable, a share drawn as corruption hits real fabrics, or
every cable alike.

Corruption is concentrated and stable (Zhuo et al., "Understanding and Mitigating Packet Corruption in
Data Center Networks", SIGCOMM 2017, 350K links in 15 data centres): of the links that corrupt packets,
47.2% lose 1e-8 to 1e-5 of them, 18.4% 1e-5 to 1e-4, 21.7% 1e-4 to 1e-3 and 12.7% 1e-3 to 1e-2,
independent of load, until repaired. ``corropt(share)`` draws that share of a fabric's directed cables
at a seed, each a Bernoulli loss at a rate log-uniform within a band drawn with those weights.
"""
from __future__ import annotations

import math

import numpy as np

from ..loss import Bernoulli, LossModel, parse_loss_model
from ..util import stream_seed
from .graph import Fabric

# (share of corrupting links, lowest rate, highest rate): Zhuo et al. 2017, the corruption-rate table
CORROPT_BANDS = ((0.472, 1e-8, 1e-5), (0.184, 1e-5, 1e-4), (0.217, 1e-4, 1e-3), (0.127, 1e-3, 1e-2))


def bad_link(fabric: Fabric, text: str) -> tuple[int, LossModel]:
    """``CABLE:MODEL`` (``leaf3-spine1:bernoulli:1e-3``, any loss spec after the cable's name) -> the
    cable's index and its loss model."""
    name, sep, model = str(text).partition(":")
    if not sep or not model.strip():
        raise ValueError(f"bad_link={text!r} must be CABLE:LOSS, e.g. leaf3-spine1:bernoulli:1e-3")
    cable = fabric.cable(name.strip())
    try:
        return cable, parse_loss_model(model)
    except ValueError as error:
        raise ValueError(f"bad_link={text!r}: {error}") from None


def corropt(fabric: Fabric, share: float, seed: int) -> dict[int, LossModel]:
    """``share`` of the fabric's directed cables (rounded, at least one when share > 0), drawn at
    ``seed``, each lossy at a rate from the corruption bands above."""
    if not 0 <= share <= 1 or math.isnan(share):
        raise ValueError(f"corrupt_share={share!r} must be a fraction from 0 to 1")
    if share == 0:
        return {}
    rng = np.random.default_rng(stream_seed(seed, fabric.name, "corropt"))
    count = max(1, round(share * len(fabric.cables)))
    cables = np.sort(rng.choice(len(fabric.cables), size=count, replace=False))
    weights = np.array([band[0] for band in CORROPT_BANDS])
    bands = rng.choice(len(CORROPT_BANDS), size=count, p=weights / weights.sum())
    low, high = (np.log10([CORROPT_BANDS[b][i] for b in bands]) for i in (1, 2))
    rates = 10 ** rng.uniform(low, high)
    return {int(c): Bernoulli(float(r)) for c, r in zip(cables, rates)}


def cable_losses(fabric: Fabric, bad_links: tuple[str, ...] = (), corrupt_share: float = 0.0,
                 every_cable=None, seed: int = 0) -> dict[int, LossModel]:
    """Each lossy directed cable's loss model: ``every_cable`` on all of them (the old assumption, kept
    for comparison), then a CorrOpt draw, then each named ``bad_links`` entry; a later one wins."""
    out: dict[int, LossModel] = {}
    if every_cable is not None:
        model = parse_loss_model(every_cable)
        if not model.lossless:
            out = dict.fromkeys(range(len(fabric.cables)), model)
    out.update(corropt(fabric, corrupt_share, seed))
    for text in bad_links:
        cable, model = bad_link(fabric, text)
        out[cable] = model
    return {c: m for c, m in out.items() if not m.lossless}
