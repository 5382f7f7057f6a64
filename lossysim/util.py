"""Small helpers every stage uses."""
from __future__ import annotations

import contextlib
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
