"""Process-wide counters behind `tpuc.stats()`."""

from __future__ import annotations

import threading
from collections import Counter

from . import _native

_lock = threading.Lock()
_stats: dict = {}
# Call plans (the hot path, in Rust) count their executions there; `stats()` adds those made
# since the last reset.
_plan_executions_at_reset = 0


def reset_stats() -> None:
    """Sets every counter back to zero."""
    global _plan_executions_at_reset
    with _lock:
        _plan_executions_at_reset = _native.plan_executions()
        _stats.clear()
        _stats.update(
            graphs_compiled=0,
            xla_compiles=0,
            cache_hits_memory=0,
            cache_hits_disk=0,
            executions=0,
            device_uploads=0,
            # calls run again by PyTorch because a topk had ties (see ties.py)
            eager_reruns=0,
            fallback_ops=Counter(),
            # Dynamo's graph breaks in frames traced for tpuc, per reason (whole_step.py)
            graph_breaks=Counter(),
            # nodes run through PyTorch's own kernel by choice (see torch_kernels.py), per op
            torch_kernels=Counter(),
            # distinct nested_compile_region subgraphs compiled (regions.py)
            regions_compiled=0,
            # distinct regions whose nodes were copied into each call site's graph (regions.py)
            regions_inlined=0,
            # chains of consecutive calls of one region compiled as one loop (block_loops.py)
            regions_looped=0,
            # stacks of a loop's parameters made (block_loops.StackedInputs; kept until written)
            block_stacks_made=0,
            # saved activations a forward graph handed to its backward channels-last (handoff.py)
            saved_channels_last=0,
            # per IR pass: {"runs", "ops_before", "ops_after", "ops_removed", "changes", "seconds"}
            passes={},
            lower_seconds=0.0,
            compile_seconds=0.0,
            # per compiled graph (Dynamo's name, e.g. "forward_0"): {"lower_seconds",
            # "compile_seconds" (XLA's, cache misses only), "xla_compiles"}
            graph_compile_seconds={},
        )


def stats() -> dict:
    """A snapshot of the counters (docs/api.md, "Statistics", lists the keys)."""
    with _lock:
        out = dict(_stats)
        out["executions"] += _native.plan_executions() - _plan_executions_at_reset
        out["fallback_ops"] = dict(_stats["fallback_ops"])
        out["torch_kernels"] = dict(_stats["torch_kernels"])
        out["graph_breaks"] = dict(_stats["graph_breaks"])
        out["passes"] = {k: dict(v) for k, v in _stats["passes"].items()}
        out["graph_compile_seconds"] = {k: dict(v) for k, v in _stats["graph_compile_seconds"].items()}
        return out


def add(**deltas) -> None:
    with _lock:
        for k, v in deltas.items():
            _stats[k] += v


def record_passes(report) -> None:
    """Adds one pipeline run's report (`FxGraph.cleanup`'s first result) to `stats()["passes"]`."""
    with _lock:
        for name, before, after, _text, seconds, changes in report:
            p = _stats["passes"].setdefault(
                name,
                {"runs": 0, "ops_before": 0, "ops_after": 0, "ops_removed": 0, "changes": 0, "seconds": 0.0},
            )
            p["runs"] += 1
            p["ops_before"] += before
            p["ops_after"] += after
            p["ops_removed"] += before - after
            p["changes"] += changes
            p["seconds"] += seconds


def record_graph_compile(graph: str, exe) -> None:
    """One executable of `graph` (from Runtime.compile): its lowering seconds, and XLA's compile
    seconds when it was compiled rather than found in a cache."""
    with _lock:
        g = _stats["graph_compile_seconds"].setdefault(
            graph, {"lower_seconds": 0.0, "compile_seconds": 0.0, "xla_compiles": 0}
        )
        g["lower_seconds"] += exe.lower_seconds
        if exe.cache == "miss":
            g["compile_seconds"] += exe.compile_seconds
            g["xla_compiles"] += 1


def count_fallback(op: str, n: int = 1) -> None:
    with _lock:
        _stats["fallback_ops"][op] += n


def count_graph_break(reason: str, n: int = 1) -> None:
    with _lock:
        _stats["graph_breaks"][reason] += n


def count_torch_kernel(op: str) -> None:
    with _lock:
        _stats["torch_kernels"][op] += 1


def count_upload() -> None:
    _stats["device_uploads"] += 1


def count_execution() -> None:
    # A plain int increment; the GIL makes it atomic enough and this is the hot path.
    _stats["executions"] += 1


reset_stats()
