"""Small helpers every stage uses."""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


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


def nearest(word: str, names) -> str | None:
    """The one of ``names`` a mistyped ``word`` most likely meant (difflib's ratio >= 0.75), or None."""
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.75)
    return close[0] if close else None


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


def numba_compiled(cache: dict, key: str, *functions, **options):
    """``functions`` compiled by numba once (``cache=True`` and ``options``), kept in ``cache[key]`` (the
    module's own, where a test puts its Python loop instead): one function, or a tuple of several; None
    where numba is not installed (the ``fast`` extra), whose callers keep their numpy or Python path."""
    if key not in cache:
        try:
            import numba
        except ImportError:
            cache[key] = None
        else:
            made = tuple(numba.njit(cache=True, **options)(f) for f in functions)
            cache[key] = made[0] if len(made) == 1 else made
    return cache[key]


_MAPPED_FROM = 1 << 20   # bytes; below, a mapping's system calls cost more than clearing the memory


def untouched_zeros(shape, dtype) -> np.ndarray:
    """A zero array whose pages cost nothing until written: a large one is an anonymous mapping, whose
    pages the kernel hands over zeroed when first touched. (``np.zeros`` is calloc, which clears memory
    the heap reuses, and glibc's heap serves blocks of up to 32 MiB once one that size was freed.)"""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size >= _MAPPED_FROM:
        try:
            return np.frombuffer(mmap.mmap(-1, size), dtype=dtype).reshape(shape)
        except OSError:   # out of mappings (vm.max_map_count): the heap's zeros are as good, only slower
            pass
    return np.zeros(shape, dtype=dtype)
