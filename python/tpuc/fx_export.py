"""FX graph -> tpuc's IR: the walk over the nodes is Rust's (`python/src/fx_walk.rs`, into the
wire structs of `frontend_fx/src/wire.rs`); this module picks what only Python can say cheaply.

`get_attr` nodes (lifted constants) become extra inputs after the placeholders; `export` returns
their targets so the runtime can pass them.
"""

from __future__ import annotations

import torch
import torch.fx

from . import _native


def symfloat_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes computing a float from sizes (`n / (n - 1)` in batch norm's running variance):
    they become 0-d float64 inputs whose values the runtime computes from the real sizes."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.SymFloat)
        and not getattr(n.meta["val"].node.expr, "is_number", False)
    ]


def export(gm: torch.fx.GraphModule, symfloats: list[torch.fx.Node] | None = None):
    """Returns (imported `_native.FxGraph`, targets of get_attr nodes in input order, whether the
    graph takes a random seed input: last, after the size-derived floats). `symfloats`: what
    `symfloat_nodes(gm)` returns, when the caller has it (None: the walk finds them)."""
    return _native.FxGraph.from_fx(gm, symfloats)


def export_cleaned(
    gm: torch.fx.GraphModule,
    symfloats: list[torch.fx.Node] | None = None,
    enabled: list[str] | None = None,
    texts: bool = False,
):
    """`export`, then the cleanup passes named in `enabled` (all when None) on the imported
    graph itself. Returns (the imported graph's text when `texts` else None, the pass report as
    `FxGraph.cleanup` gives it, the cleaned `_native.FxGraph`, get_attr targets, whether the
    graph takes a random seed input)."""
    return _native.FxGraph.from_fx_cleaned(gm, symfloats, enabled, texts)
