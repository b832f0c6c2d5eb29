"""Process-wide counters behind `tpuc.stats()`."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_stats: dict = {}


def reset_stats() -> None:
    """Sets every counter back to zero."""
    with _lock:
        _stats.clear()
        _stats.update(
            graphs_compiled=0,
            xla_compiles=0,
            cache_hits_memory=0,
            cache_hits_disk=0,
            executions=0,
            device_uploads=0,
            fallback_ops=Counter(),
            lower_seconds=0.0,
            compile_seconds=0.0,
        )


def stats() -> dict:
    """A snapshot of the counters (see API.md for the keys)."""
    with _lock:
        out = dict(_stats)
        out["fallback_ops"] = dict(_stats["fallback_ops"])
        return out


def add(**deltas) -> None:
    with _lock:
        for k, v in deltas.items():
            _stats[k] += v


def count_fallback(op: str, n: int = 1) -> None:
    with _lock:
        _stats["fallback_ops"][op] += n


def count_upload() -> None:
    _stats["device_uploads"] += 1


def count_execution() -> None:
    # A plain int increment; the GIL makes it atomic enough and this is the hot path.
    _stats["executions"] += 1


reset_stats()
