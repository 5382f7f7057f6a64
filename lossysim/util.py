"""Small helpers every stage uses."""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any):
    """Set ``owner.name = value`` for the duration of a ``with`` block, then put the old value back."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield value
    finally:
        setattr(owner, name, previous)


def stream_seed(seed: int, site: str, direction: str) -> int:
    """A stable 63-bit seed for one (seed, site, direction) random stream."""
    digest = hashlib.blake2b(f"{seed}\0{site}\0{direction}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def one_of(values) -> str:
    """``one of a, b, c``: how a help text or an error lists the values a setting takes, written from
    the tuple that defines them, so neither names a value that is gone nor misses a new one."""
    return "one of " + ", ".join(values)


def cache_dir() -> Path:
    """lossysim's cache (prepared data, converted models): LOSSYSIM_CACHE, else ~/.cache/lossysim."""
    return Path(os.environ.get("LOSSYSIM_CACHE", Path.home() / ".cache" / "lossysim"))


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's ``__getattr__`` (PEP 562) that imports each of ``exports``' names (name -> the module
    holding it, relative to ``package``) when first asked for, and keeps it: reading one light module of a
    package (an axis's declaration) then costs none of the rest."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
