"""The spec mini-language of the time model: ``[preset,]key=value,...`` with units.

Links (``roce-200g,alpha=10us``) and compute models (``h100,mfu=0.35``) are written the same
way: a preset name, then fields that override it. Times take s/ms/us/ns, rates bps or B/s with
K/M/G/T prefixes; every value formats back to a spec that reads as the exact same number.
"""
from __future__ import annotations

import re

_TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_RATE_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE_UNIT = re.compile(r"^\s*([0-9.eE+-]+)\s*([kKMGT]?)(bps|b/s|Bps|B/s)\s*$")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


def shortest(x: float) -> str:
    """The shortest decimal that reads back as exactly ``x``."""
    return next(t for t in (f"{x:.{d}g}" for d in range(1, 18)) if float(t) == x)


def _decimal(scaled: float, exact) -> str:
    """The shortest rounding of ``scaled`` whose text satisfies ``exact``; repr if none."""
    for places in range(16):
        text = repr(round(scaled, places)).removesuffix(".0")
        if exact(text):
            return text
    return repr(scaled)


def format_time(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    for unit in ("s", "ms", "us", "ns"):
        divisor = _TIME_UNITS[unit]
        text = _decimal(seconds * divisor, lambda t: float(t) / divisor == seconds)
        if (float(text) >= 1 or unit == "ns") and float(text) / divisor == seconds:
            return text + unit
    return f"{seconds!r}s"


def format_rate(bytes_per_s: float) -> str:
    for prefix in ("T", "G", "M", "K", ""):
        factor = _RATE_PREFIX[prefix]
        text = _decimal(bytes_per_s * 8 / factor, lambda t: float(t) * factor / 8 == bytes_per_s)
        if float(text) >= 1 and float(text) * factor / 8 == bytes_per_s:
            return text + prefix + "bps"
    return f"{bytes_per_s!r}B/s"


def parse_time(field: str, text: str) -> float:
    match = re.match(r"^\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)\s*$", text)
    try:
        if match:
            return float(match.group(1)) / _TIME_UNITS[match.group(2)]
    except ValueError:
        pass
    raise ValueError(f"{field}={text!r} is not a time with a unit (s, ms, us, ns)")


def parse_rate(field: str, text: str) -> float:
    match = _RATE_UNIT.match(text)
    try:
        if match:
            value = float(match.group(1)) * _RATE_PREFIX[match.group(2)]
            return value / 8 if match.group(3) in ("bps", "b/s") else value
    except ValueError:
        pass
    raise ValueError(f"{field}={text!r} is not a rate with a unit (bps, Kbps, Mbps, Gbps, Tbps "
                     "or B/s, KB/s, MB/s, GB/s, TB/s)")


def parse_bytes(field: str, text: str) -> int:
    text = text.strip().removesuffix("B")
    if not re.match(r"^\d+$", text):
        raise ValueError(f"{field}={text!r} is not a whole number of bytes")
    return int(text)


def split_spec(text: str, keys: tuple[str, ...], presets: dict) -> tuple[str | None, dict]:
    """``[preset,]key=value,...`` -> (preset or None, {key: text}), one-line errors."""
    if not text:
        raise ValueError(f"empty spec; expected a preset ({', '.join(presets)}) or {'=..,'.join(keys)}=..")
    items = [item.strip() for item in text.split(",")]
    preset = None
    if items and "=" not in items[0]:
        preset = items.pop(0)
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(presets)} "
                             f"or {'=..,'.join(keys)}=..")
    values = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{item!r} is not key=value")
        if key not in keys:
            raise ValueError(f"unknown key {key}={value}; expected {', '.join(keys)}")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = value.strip()
    return preset, values
