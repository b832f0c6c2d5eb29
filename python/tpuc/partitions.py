"""A graph with ops tpuc does not lower, split into tpuc partitions (each a `CompiledGraph`) and
the ops that run in PyTorch (`fallback="eager"`), with one warning per op."""

from __future__ import annotations

import threading
import warnings

import torch
import torch.fx

from . import _native, user_code
from .compiled_graph import _lowering_fallback
from .op_support import _supported

_warned_fallback: set[str] = set()
_warn_lock = threading.Lock()


class _PartitionModule(torch.nn.Module):
    """Stands in for a compiled piece of a graph: a partition of supported ops inside a graph
    that also runs eager ops, or a piece between region call sites (`regions.compile_split`).
    `compiled` is a boxed callable (a `CompiledGraph` or a wrapper of one)."""

    def __init__(self, compiled, single_output: bool):
        super().__init__()
        self.compiled = compiled
        self.single_output = single_output

    def forward(self, *args):
        outs = self.compiled(list(args))
        return outs[0] if self.single_output else tuple(outs)


def _origin(n: torch.fx.Node, traces: dict) -> str:
    """`, from model.py:12 (code)`: where the user's code produced `n`, or ""."""
    where = user_code.describe(n, traces)
    return f", from {where}" if where else ""


def _warn_fallback(ops: list[str]) -> None:
    with _warn_lock:
        new = sorted(set(ops) - _warned_fallback)
        _warned_fallback.update(new)
    if new:
        warnings.warn(
            f"tpuc: running {len(new)} op(s) without a lowering rule in eager PyTorch: {', '.join(new)}",
            stacklevel=3,
        )


def replace_pieces(gm: torch.fx.GraphModule, supported, compile_one) -> torch.fx.GraphModule:
    """Splits `gm` into the largest pieces of nodes for which `supported(node)` holds (torch's
    CapabilityBasedPartitioner) and puts `compile_one(piece, piece_name)` (a boxed callable
    returning a list, or None: the piece runs in PyTorch) in each one's place. The nodes left
    out run in PyTorch between them."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupport

    class Support(OperatorSupport):
        def is_node_supported(self, submodules, node):
            return supported(node)

    partitioner = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    for node in list(fused.graph.nodes):
        if node.op != "call_module":
            continue
        sub = getattr(fused, node.target)
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        out_arg = out_node.args[0]
        single = not isinstance(out_arg, list | tuple)
        if single:
            # Compiled graphs always return a list; give the subgraph a tuple output.
            out_node.args = ((out_arg,),)
            sub.recompile()
        compiled = compile_one(sub, node.target)
        if compiled is not None:
            setattr(fused, node.target, _PartitionModule(compiled, single))
        elif single:
            out_node.args = (out_arg,)  # stays eager: restore its original output
            sub.recompile()
    fused.recompile()
    return fused


def _partitioned(gm: torch.fx.GraphModule, road, name: str, maxima=None, shard=None, in_torch=frozenset()):
    """Splits `gm` into tpuc partitions (supported ops) and eager ops (unsupported ones, and
    the nodes of `in_torch`)."""
    part_shard = (shard[0], "partition") if shard is not None else None
    return replace_pieces(
        gm,
        lambda node: node not in in_torch and _supported(node),
        lambda sub, piece: _compile_or_fallback(sub, road, f"{name}.{piece}", maxima, part_shard),
    )


def _compile_or_fallback(
    gm: torch.fx.GraphModule, road, name: str, maxima=None, shard=None, free_layouts=None
):
    """The road's ending for `gm` (road.Road.ending: a CompiledGraph's entry point here), or
    None (run `gm` eagerly) when lowering fails and fallback="eager".
    Plugin errors always raise: they are not a matter of op coverage."""
    try:
        return road.ending(gm, name, maxima, shard, free_layouts)
    except _native.TpucError as e:
        if road.opts.fallback == "error" or isinstance(e, _native.PjrtError):
            raise
        _lowering_fallback(e, name)
        return None
