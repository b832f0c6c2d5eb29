"""The graphs a running `tpuc.precompile` traces: `CompiledGraph` records each graph it makes
here, and precompile compiles them for every bucket (precompiler.py)."""

from __future__ import annotations

import contextlib
import re
import threading

import torch

_session = threading.local()
_SOURCE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")


@contextlib.contextmanager
def recording():
    """Inside the block, `record_graph` appends to the list it yields (on this thread)."""
    _session.graphs = []
    try:
        yield _session.graphs
    finally:
        _session.graphs = None


def record_graph(compiled_graph) -> None:
    """Called by the backend for each graph it compiles: inside `precompile`, remembers the graph
    and which (argument, dim) each of its size symbols stands for."""
    graphs = getattr(_session, "graphs", None)
    if graphs is None:
        return
    symbols = {}
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None and ctx.fake_mode.shape_env is not None:
        for sym, sources in ctx.fake_mode.shape_env.var_to_sources.items():
            for src in sources:
                m = _SOURCE.match(src.name)
                if m:
                    symbols[str(sym)] = (m.group(1), int(m.group(2)))
                    break
    graphs.append((compiled_graph, symbols))
