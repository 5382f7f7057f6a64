"""Is the Hugging Face hub reachable? Asked once per process, before anything downloads.

Without this, every model, tokenizer and data set load on a machine that cannot reach the hub
retries with backoff (about 20 s per file, several files per run). ``hub_reachable`` opens one
TCP connection to the endpoint (``HF_ENDPOINT``) with a short timeout; when it fails, offline
mode is switched on for the rest of the process (the environment and the constants the hub
libraries have already read), so every later load answers from the local cache at once and
fails, when something is not cached, with its usual one-line reason.

``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set by the user are
honoured: no probe is made.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import urllib.request
from typing import Optional
from urllib.parse import urlsplit

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_TIMEOUT_S = 2.0
_TRUE = ("1", "true", "yes", "on")

_state: dict = {}   # "reachable": bool, "why": str (why the hub is not used), once per process


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_vars() -> list[str]:
    """The offline variables the user set (before this module switched any on)."""
    return [v for v in OFFLINE_VARS if os.environ.get(v, "").strip().lower() in _TRUE]


def _address(url: str) -> tuple[Optional[str], int]:
    """Where a connection to ``url`` goes first: the configured proxy for its scheme, if any
    (HTTPS_PROXY, ALL_PROXY, ...) and the host is not in NO_PROXY, else the host itself."""
    parts = urlsplit(url)
    scheme = parts.scheme or "https"
    proxy = urllib.request.getproxies().get(scheme) or urllib.request.getproxies().get("all")
    if proxy and parts.hostname and not urllib.request.proxy_bypass(parts.hostname):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        scheme = parts.scheme
    return parts.hostname, parts.port or (443 if scheme == "https" else 80)


def _probe(url: str, timeout: float) -> Optional[str]:
    """None when a TCP connection to the endpoint (or its proxy) opens within ``timeout``, else
    why not. Name resolution counts against the timeout too (it runs in a thread)."""
    host, port = _address(url)
    if not host:
        return f"HF_ENDPOINT={url!r} names no host"
    answer: list = []

    def connect():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                answer.append(None)
        except socket.gaierror:
            answer.append(f"cannot resolve {host}")
        except socket.timeout:
            answer.append(f"no answer from {host}:{port} within {timeout:g} s")
        except OSError as err:
            answer.append(f"{host}:{port}: {err.strerror or err}")

    worker = threading.Thread(target=connect, name="hub-probe", daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    return answer[0] if answer else f"no answer from {host}:{port} within {timeout:g} s"


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when the hub can be reached; the answer is cached for the process.

    False (and offline mode on) when the user set an offline variable, or when the probe fails.
    """
    quiet_retries()
    if "reachable" not in _state:
        user = offline_vars()
        if user:
            _state.update(reachable=False, why=f"offline mode is on ({', '.join(f'{v}=1' for v in user)})")
        else:
            failed = _probe(endpoint(), timeout)
            _state.update(reachable=failed is None,
                          why=None if failed is None else f"the hub ({endpoint()}) could not be reached: {failed}")
        if not _state["reachable"]:
            go_offline()
            logging.getLogger(__name__).info("%s; using the local cache only", _state["why"])
    return _state["reachable"]


def why_unavailable() -> Optional[str]:
    """Why the hub is not used (offline mode, or the failed probe), None when it is reachable."""
    hub_reachable()
    return _state.get("why")


def go_offline() -> None:
    """Offline mode for this process: the environment (read at import) and the constants that
    huggingface_hub, datasets and transformers already read, when they are imported."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True


def reset() -> None:
    """Forget the answer (tests; a process whose network changed)."""
    _state.clear()


class _OncePerMessageKind(logging.Filter):
    """Let through the first retry / connection warning of huggingface_hub, drop the rest,
    unless debug logging (``-v``) is on."""

    MARKERS = ("Retrying in", "thrown while requesting")

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        message = record.getMessage()
        if not any(marker in message for marker in self.MARKERS):
            return True
        if self.seen:
            return False
        self.seen = True
        return True


_FILTER = _OncePerMessageKind()


def quiet_retries() -> None:
    """Hub retry and backoff warnings appear at most once per process (all of them with -v)."""
    for name in ("huggingface_hub.utils._http", "huggingface_hub.file_download"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
