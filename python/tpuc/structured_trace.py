"""tpuc's artifacts in PyTorch's structured trace (`TORCH_TRACE=<dir>`, read with tlparse).

For each executable a graph gets, three named artifacts go beside Dynamo's and AOTAutograd's
graphs: `tpuc_stablehlo_<graph>` (the StableHLO module sent to the plugin, with its ops'
source locations), `tpuc_optimized_hlo_<graph>` (XLA's optimized HLO, where the plugin gives
it) and `tpuc_compile_<graph>` (JSON: cache outcome and key, lower and compile seconds,
bindings). Nothing is computed unless the trace is on: PyTorch's trace logger has a handler
only under `TORCH_TRACE` (or `torch._logging` set to trace), and the payloads are built lazily
by `trace_structured` itself. (PyTorch keeps a lazy handler on its trace logger even without
`TORCH_TRACE`, one that writes nothing: `trace_structured` would still build every payload, so
tpuc asks whether a handler will write before anything else.)
"""

from __future__ import annotations

import json
import logging

from torch._logging import trace_structured
from torch._logging._internal import LazyTraceHandler, trace_log


def on() -> bool:
    """Whether PyTorch's structured trace is being written: its lazy handler with a folder, or
    a handler of the trace logger's own (ordinary log handlers that a host copies onto every
    logger, as pytest's capture, are also on the root logger and do not count)."""
    handlers = trace_log.handlers
    if not handlers:
        return False
    root = logging.getLogger().handlers
    for h in handlers:
        if isinstance(h, LazyTraceHandler):
            if h.root_dir is not None or h.stream is not None:
                return True
        elif h not in root:
            return True
    return False


def record(name: str, exe, bindings: dict | None = None) -> None:
    """Writes `exe`'s artifacts for graph `name` into the structured trace, when it is on."""
    if not on():
        return
    tag = name.replace(".", "_")

    def artifact(kind: str, encoding: str, payload_fn) -> None:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"tpuc_{kind}_{tag}", "encoding": encoding},
            payload_fn=payload_fn,
            # Graphs compiled per shape at call time run outside Dynamo's compile context.
            expect_trace_id=False,
        )

    artifact("stablehlo", "string", lambda: exe.mlir_with_locations)
    hlo = exe.optimized_hlo()
    if hlo is not None:
        artifact("optimized_hlo", "string", lambda: hlo)
    artifact(
        "compile",
        "json",
        lambda: json.dumps(
            {
                "graph": name,
                "bindings": {str(k): int(v) for k, v in (bindings or {}).items()},
                "cache": exe.cache,
                "key": exe.key,
                "lower_seconds": exe.lower_seconds,
                "compile_seconds": exe.compile_seconds,
            }
        ),
    )
