"""Which tensor-parallel call sites can lose packets: ``lossy_layers`` and ``lossy_sites``.

A TP call site is named ``<blocks>.<layer>.<module>.<copy|reduce>`` (``h.3.attn.reduce``,
``layers.12.mlp.copy``, see ``lossysim.tp.parallelize``). A selection keeps the loss model on the
sites of some layers (``"all"``, ``"3"``, ``"0-5,12"``) and of some modules (``all``, ``attn``: the
attention block's sites, ``mlp``: the MLP's); every other site's traffic is delivered intact, still
counted and timed. This is how one asks where loss hurts (one layer, or one site, at a time) in a
training run, a sweep or a forward pass alike.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

ALL = "all"
MAX_LAYERS = 10_000
SITE_KINDS = ("attn", "mlp")
_SITE = re.compile(r"(?:^|\.)(\d+)\.(\w+)\.(?:copy|reduce)$")
_MODULES = {"attn": "attn", "self_attn": "attn", "mlp": "mlp"}


def parse_layers(value) -> Optional[frozenset[int]]:
    """``"all"`` -> None; ``"3"``, ``"0-5,12"`` (or an int) -> the layer indices. ValueError naming
    ``lossy_layers`` otherwise."""
    text = str(value).strip().lower()
    if text == ALL:
        return None
    layers = set()
    for part in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"lossy_layers={value!r} must be all, or layer indices and ranges separated by "
                             "commas (e.g. 3 or 0-5,12)")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last >= MAX_LAYERS:  # no model is this deep; a typo must not expand into a huge set
            raise ValueError(f"lossy_layers={value!r}: layer {last} is beyond any model (at most {MAX_LAYERS - 1})")
        layers.update(range(first, last + 1))
    return frozenset(layers)


def parse_sites(value) -> Optional[str]:
    """``"all"`` -> None, else ``attn`` or ``mlp``; ValueError naming ``lossy_sites`` otherwise."""
    text = str(value).strip().lower()
    if text == ALL:
        return None
    if text not in SITE_KINDS:
        raise ValueError(f"lossy_sites={value!r} must be one of all, {', '.join(SITE_KINDS)}")
    return text


@dataclass(frozen=True)
class SiteSelection:
    """The parsed ``lossy_layers`` and ``lossy_sites`` (None: every layer / every kind)."""
    layers: Optional[frozenset[int]] = None
    kind: Optional[str] = None

    @classmethod
    def parse(cls, layers, sites) -> "SiteSelection":
        return cls(parse_layers(layers), parse_sites(sites))

    @property
    def everything(self) -> bool:
        return self.layers is None and self.kind is None

    def covers(self, site: str) -> bool:
        """Whether call site ``site`` is selected; a site outside the TP blocks only when nothing is
        narrowed."""
        if self.everything:
            return True
        match = _SITE.search(site)
        if match is None:
            return False
        layer, module = int(match.group(1)), _MODULES.get(match.group(2))
        return (self.layers is None or layer in self.layers) and (self.kind is None or module == self.kind)

    def check_depth(self, layers: int) -> None:
        """Refuse layer indices a model of ``layers`` blocks does not have."""
        beyond = sorted(i for i in (self.layers or ()) if i >= layers)
        if beyond:
            raise ValueError(f"lossy_layers names layer {beyond[0]}, but the model has {layers} layers "
                             f"(0-{layers - 1})")
