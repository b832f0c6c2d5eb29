"""FX graph -> tpuc's IR: the walk over the nodes is Rust's (`python/src/fx_walk.rs`, into the
wire structs of `frontend_fx/src/wire.rs`).

`get_attr` nodes (lifted constants) become extra inputs after the placeholders, then the
size-derived floats (`SymFloat`-valued nodes such as `n / (n - 1)` in batch norm's running
variance, 0-d float64 inputs whose values the runtime computes from the real sizes), then the
random seed; `export` returns the targets of the first so the runtime can pass them.
"""

from __future__ import annotations

import torch
import torch.fx

from . import _native


def export(gm: torch.fx.GraphModule):
    """Returns (imported `_native.FxGraph`, targets of get_attr nodes in input order, whether the
    graph takes a random seed input: last, after the size-derived floats)."""
    return _native.FxGraph.from_fx(gm)


def export_cleaned(gm: torch.fx.GraphModule, enabled: list[str] | None = None, texts: bool = False):
    """`export`, then the cleanup passes named in `enabled` (all when None) on the imported
    graph itself. Returns (the imported graph's text when `texts` else None, the pass report as
    `FxGraph.cleanup` gives it, the cleaned `_native.FxGraph`, get_attr targets, whether the
    graph takes a random seed input, the size-derived float nodes in input order)."""
    return _native.FxGraph.from_fx_cleaned(gm, enabled, texts)
