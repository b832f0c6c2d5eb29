"""Where in the user's code an FX node comes from, for messages (an op without a rule, the
largest tensors of a program that does not fit): the innermost frame of the stack trace Dynamo
recorded, PyTorch's own frames left out, read by the same code that puts source locations on
the lowered ops (`_native.user_frame`)."""

from __future__ import annotations

import linecache
import os

import torch

from . import _native

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _stack_trace(node: torch.fx.Node, traces: dict | None) -> str:
    """The node's stack trace, or that of the Dynamo node it came from: AOTAutograd's nodes
    point back through `from_node`, and `traces` maps Dynamo's node names to their traces."""
    trace = node.meta.get("stack_trace")
    source = (node.meta.get("from_node") or [None])[-1]
    while not trace and source is not None and traces:
        trace = traces.get(source.name)
        source = (source.from_node or [None])[-1]
    return trace or ""


def describe(node: torch.fx.Node, traces: dict | None = None) -> str:
    """`file.py:12 (c = a * b)`: the user's line and its code, or "" when not known."""
    frame = _native.user_frame(_stack_trace(node, traces), [_TORCH_DIR])
    if frame is None:
        return ""
    code = linecache.getline(frame[0], frame[1]).strip()
    return f"{frame[0]}:{frame[1]}" + (f" ({code})" if code else "")
