"""AOTAutograd's compiler hook (`compile_graph`): one forward or backward graph to a boxed
callable, on the one road (road.py). The preparation table (prepare.py) takes writes into
inputs, outputs that are views of inputs, runtime checks and tie-order checks out of the graph
(done around the call); compile regions, PyTorch's own kernels and unsupported ops are
partitioned off; the rest ends the road (`Road.ending`: here, a target, its stand-in)."""

from __future__ import annotations

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from . import _native, counters, prepare, regions, targets, torch_kernels
from .op_support import _unsupported_nodes, _why_unsupported
from .partitions import _compile_or_fallback, _origin, _partitioned, _warn_fallback


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs,
    road,
    name: str,
    traces: dict | None = None,
    maxima=None,
    shard=None,
    free_layouts=None,
):
    """AOTAutograd's compiler hook: a boxed callable that runs `gm` through tpuc, on `road`
    (road.Road: the compile's options, plugin and ending). `traces` maps Dynamo node names to
    their stack traces, for error messages; `shard`: (sharding Context, "forward" | "backward")
    when a mesh is set; `free_layouts`: see CompiledGraph."""
    job = prepare.Job(gm, name, maxima, shard, free_layouts)
    wrap = prepare.run(road, job)
    return wrap(_compile_hook(gm, road, name, traces, maxima, shard, job.free_layouts))


def _compile_hook(
    gm: torch.fx.GraphModule, road, name: str, traces: dict | None, maxima, shard, free_layouts=None
):
    """Regions compiled once each (each through the whole road), the rest one executable, or
    partitions around what runs in PyTorch (never on a target: its graphs lower entirely)."""
    traces = traces or {}
    opts = road.opts
    part_shard = (shard[0], "partition") if shard is not None else None
    in_regions = regions.compile_regions(
        gm,
        lambda sub, ins, sub_name: compile_graph(
            sub, ins, road, f"{name}.{sub_name}", traces, maxima, part_shard
        ),
    )
    bad = [n for n in _unsupported_nodes(gm) if n not in in_regions]
    if road.spec is not None:
        targets.check_lowerable(bad, name, road.spec)
    in_torch = _torch_kernel_nodes(gm, road, shard)
    if not bad and not in_torch and not in_regions:
        compiled = _compile_or_fallback(gm, road, name, maxima, shard, free_layouts)
        return compiled if compiled is not None else make_boxed_func(gm.forward)
    for n in in_torch:
        counters.count_torch_kernel(str(n.target))
    in_torch = [*in_torch, *in_regions]
    if not bad:
        return make_boxed_func(_partitioned(gm, road, name, maxima, shard, set(in_torch)).forward)
    if opts.fallback == "error":
        n = bad[0]
        details = "\n".join(f"  - `{b.target}` (node `{b.name}`){_origin(b, traces)}" for b in bad)
        err = _native.UnsupportedOpError(
            f"unsupported op `{n.target}` (node `{n.name}`): {_why_unsupported(n)}; "
            f"{len(bad)} unsupported node(s) in this graph:\n{details}\n"
            "use options={'fallback': 'eager'} to run them in PyTorch"
        )
        err.op, err.node = str(n.target), n.name
        raise err
    ops = [str(n.target) for n in bad]
    for op in ops:
        counters.count_fallback(op)
    _warn_fallback(ops)
    fused = _partitioned(gm, road, name, maxima, shard, set(in_torch))
    return make_boxed_func(fused.forward)


def _torch_kernel_nodes(gm: torch.fx.GraphModule, road, shard) -> list[torch.fx.Node]:
    """The nodes to run through PyTorch's own kernel (see torch_kernels.py): only on the CPU
    plugin and unsharded (a partitioned graph would leave the mesh)."""
    if shard is not None or not road.torch_kernels:
        return []
    return torch_kernels.nodes(gm)
