"""Regions marked with `@torch.compiler.nested_compile_region`, compiled once each.

PyTorch's way to say "this block repeats, compile it once": Dynamo and AOTAutograd keep each
marked block as a subgraph (a GraphModule attribute of the graph) called through the
`invoke_subgraph` higher-order op, `invoke_subgraph(subgraph, identifier, *operands)`, once per
call site, in the forward graph and (with its own backward subgraph) in the backward graph.

Three ways to compile them (option `regions`, chosen by measurement: bench/results/regions.md,
bench/results/block_loops.md):

* "loop" (the default on TPU and for targets): consecutive calls of one region become one
  loop over the blocks' stacked parameters (block_loops.py), the calls left are inlined: one
  program that holds each block once.
* "executables" (the default on GPU): tpuc compiles each distinct subgraph
  once, as a graph of its own (`compile_graph`: the region's executable, its call plan), and every
  call site of it launches that executable: a model of N identical blocks lowers and XLA-compiles
  one block instead of N, at the cost of one launch per block and no fusion across block
  boundaries. The rest of the graph is split around the call sites with the fallback partitioner
  (as for torch_kernels.py); the call sites are not fallbacks (nothing is warned or counted in
  `fallback_ops`). XLA:TPU compiles a GPT-2 block in tens of seconds: compiling it once is the
  gain there.
* "inline" (the default on the CPU plugin): every call site gets the region's nodes, and the graph
  compiles as one executable. Dynamo and AOTAutograd have still traced the block once (most of a
  CPU first call); XLA's CPU compile of the whole graph costs about what the split one does
  (GPT-2 124M: 1.0 vs 1.1 s), and steady calls are the unmarked model's (separate executables
  were 6-7% slower per call on a quiet host, 12-23% under load: one execution per block, each
  starting XLA's threads).
"""

from __future__ import annotations

import copy
import operator

import torch

from . import counters

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


class RegionCall:
    """What a call site of a compiled region runs (an FX `call_function` target): the region's
    compiled graph on the operands, its outputs as a tuple like `invoke_subgraph`'s."""

    def __init__(self, compiled, name: str):
        self.compiled = compiled
        self.name = name
        self.__name__ = f"tpuc_region_{name}"

    def __call__(self, *operands):
        return tuple(self.compiled(list(operands)))

    def __repr__(self) -> str:
        return f"tpuc.region({self.name})"


#: Where `regions="auto"` makes chains of calls of one region loops (block_loops.py), by
#: measurement (bench/results/block_loops.md): XLA:TPU compiles the loop in less time than one
#: executable per region, whatever the depth. The CPU plugin inlines (its training step is
#: slower with the loop); GPUs are not measured yet and keep one executable per region.
LOOP_FAMILIES = ("target", "tpu")


def mode(opts, plugin_family: str, bucketed_or_sharded: bool = False) -> str:
    """How regions compile for these options on a plugin of `plugin_family` ("cpu", "tpu", ...;
    "target" for a target's compile): "loop", "inline" or "executables" (see the module's
    docstring). `"auto"` keeps one executable per region for a graph with declared maxima or a
    mesh, where loops are not padded to buckets or placed on a mesh yet."""
    if opts.regions != "auto":
        return opts.regions
    if plugin_family == "cpu":
        return "inline"
    if plugin_family in LOOP_FAMILIES and not bucketed_or_sharded:
        return "loop"
    return "executables"


def looped(opts, plugin_family: str, bucketed_or_sharded: bool = False) -> bool:
    """Whether chains of calls of one region become loops (block_loops.py)."""
    return mode(opts, plugin_family, bucketed_or_sharded) == "loop"


def inlined(opts, plugin_family: str, bucketed_or_sharded: bool = False) -> bool:
    """Whether calls of regions are inlined: all of them, or (`"loop"`) those left after
    block_loops (a lone call, a chain that cannot be a loop), so the graph is one program."""
    return mode(opts, plugin_family, bucketed_or_sharded) in ("inline", "loop")


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """Replaces every `invoke_subgraph` call of `gm` by a copy of its region's nodes (regions in
    regions too). Returns how many distinct regions were inlined."""
    sites = call_sites(gm)
    seen: set[int] = set()
    for n in sites:
        attr, _identifier, *operands = n.args
        sub = getattr(gm, attr.target) if isinstance(attr, torch.fx.Node) else attr
        seen.add(id(sub))
        body = sub
        if call_sites(sub):  # regions in the region: inlined in a copy (PyTorch may run `sub`)
            body = torch.fx.GraphModule(sub, copy.deepcopy(sub.graph))
            inline_regions(body)
        env: dict = dict(zip((p for p in body.graph.nodes if p.op == "placeholder"), operands, strict=True))
        with gm.graph.inserting_before(n):
            for m in body.graph.nodes:
                if m.op == "get_attr":  # the region's own constants, under a name of the caller's
                    name = f"_region_{attr.target if isinstance(attr, torch.fx.Node) else 'attr'}_{m.target}"
                    name = name.replace(".", "_")
                    setattr(gm, name, getattr(body, m.target))
                    env[m] = gm.graph.get_attr(name)
            out = gm.graph.graph_copy(body.graph, env)
        outs = out if isinstance(out, list | tuple) else (out,)
        for user in list(n.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                gm.graph.erase_node(user)
        if n.users:
            raise RuntimeError(f"tpuc: a use of region call `{n.name}` other than taking its outputs apart")
        gm.graph.erase_node(n)
    if sites:
        for n in list(gm.graph.nodes):
            if n.op == "get_attr" and not n.users:
                gm.graph.erase_node(n)
        gm.graph.lint()
        gm.recompile()
        counters.add(regions_inlined=len(seen))
    return len(seen)


def call_sites(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is INVOKE_SUBGRAPH]


def compile_regions(gm: torch.fx.GraphModule, compile_region) -> set[torch.fx.Node]:
    """Replaces every `invoke_subgraph` node of `gm` by a call of its region's compiled graph,
    compiling each distinct subgraph once with `compile_region(subgraph, example_inputs, name)`
    (a boxed callable). Returns the nodes to run outside tpuc's partitions: the call sites and
    the `getitem`s that take their outputs apart."""
    sites = call_sites(gm)
    if not sites:
        return set()
    compiled: dict[int, RegionCall] = {}
    outside: set[torch.fx.Node] = set()
    for n in sites:
        attr, _identifier, *operands = n.args
        sub = getattr(gm, attr.target) if isinstance(attr, torch.fx.Node) else attr
        call = compiled.get(id(sub))
        if call is None:
            examples = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in operands]
            # compile_graph rewrites the graph it is given; PyTorch may still run the original
            # (ties.py reruns the caller's graph as it was)
            region = torch.fx.GraphModule(sub, copy.deepcopy(sub.graph))
            name = attr.target if isinstance(attr, torch.fx.Node) else "region"
            call = RegionCall(compile_region(region, examples, name), name)
            compiled[id(sub)] = call
            counters.add(regions_compiled=1)
        n.target = call
        n.args = tuple(operands)
        n.kwargs = {}
        outside.add(n)
        outside.update(u for u in n.users if u.op == "call_function" and u.target is operator.getitem)
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return outside


def compile_split(gm: torch.fx.GraphModule, name: str, compile_piece):
    """A boxed callable for a graph that must lower entirely (a target's: no PyTorch pieces):
    each distinct region compiled once (by this function: regions may nest), the rest of `gm`
    in pieces between the call sites, each compiled by `compile_piece(piece, piece_name)` (a
    boxed callable). What runs on the host is the graph of launches and `getitem`s around them.
    A graph without regions is `compile_piece(gm, name)` itself."""
    from torch._functorch.aot_autograd import make_boxed_func

    from .partitions import replace_pieces

    outside = compile_regions(
        gm, lambda sub, _ins, sub_name: compile_split(sub, f"{name}.{sub_name}", compile_piece)
    )
    if not outside:
        return compile_piece(gm, name)
    fused = replace_pieces(
        gm,
        lambda node: node.op == "call_function" and node not in outside,
        lambda sub, piece: compile_piece(sub, f"{name}.{piece}"),
    )
    return make_boxed_func(fused.forward)
