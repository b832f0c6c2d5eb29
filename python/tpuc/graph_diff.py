"""Where tpuc's result leaves eager's: per Dynamo graph, then per op (issue 40); `tpuc graph-diff`.

A debugging backend for `torch.compile`: every Dynamo graph is compiled by tpuc, and each call
runs tpuc's executable and the eager GraphModule on the same inputs (tpuc's outputs go on, so
the model runs as it does with `backend="tpu"`). Per graph and call it records every output's
largest error relative to the output's largest magnitude. A difference there is the graph's own,
not carried in from an earlier graph (both sides got the same inputs).

`locate()` then takes one recorded call of a graph and goes op by op: the graph is compiled
again with every intermediate tensor as an output (each taken right after its op, before any
later in-place op), and for each node these errors are printed:

- `local`: tpuc's value against the node's eager op run on *tpuc's* values of its inputs (the
  op's own error, nothing carried in);
- `carried`: tpuc's value against eager's value of the whole graph (the error so far);
- `eager-64`, `tpuc-64` (float32 nodes): eager's and tpuc's float32 results of the op on the
  same inputs against the op computed in float64, the value both round toward: where tpuc's is
  of the order of eager's, the local difference is rounding (another summation order), not a bug.

The first node whose local error is beyond its dtype's rounding (a few units in the last place
times the reduction length) is the op to look at; nodes whose local error stays at rounding
while the carried error grows show a chain of last-bit differences instead.

    from tpuc.graph_diff import GraphDiff
    diff = GraphDiff()
    torch.compile(model, backend=diff)(inputs)
    diff.report()                 # per graph and call: per-output relative error
    diff.locate(diff.worst())     # per op of the worst call

Command line, on a model a factory builds (`FACTORY()` returns `(model, args)`, the positional
arguments of one call):

    tpuc graph-diff MODULE:FACTORY [--locate] [--threshold 1e-5] [--at GRAPH CALL] [--show 40]

(--locate: the first call beyond --threshold, or --at's.) Each graph runs in tpuc and in eager;
the located one is compiled a second time with its intermediate outputs. bench/graph_diff.py
runs it on torchvision's detection models.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import torch
import torch.fx

REL_FLAG = {torch.float32: 1e-5, torch.float64: 1e-12}  # a graph beyond these is recorded in full


def rel_error(ref, got) -> float:
    """Largest |ref - got| over ref's largest magnitude (0 for equal or empty tensors and where
    both sides have NaN; inf on a shape mismatch, on unequal integer tensors and where one side
    has NaN and the other not)."""
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        return 0.0 if ref == got else float("inf")
    if ref.shape != got.shape:
        return float("inf")
    if ref.numel() == 0:
        return 0.0
    if not (ref.is_floating_point() or ref.is_complex()):
        return 0.0 if torch.equal(ref, got.to(ref.dtype)) else float("inf")
    r, g = ref.detach().double(), got.detach().double()
    both_nan = r.isnan() & g.isnan()
    diff = torch.where(both_nan, 0.0, (r - g).abs()).nan_to_num(float("inf"))
    scale = r.nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    return diff.max().item() / (scale if scale > 0 else 1.0)


def _flat(x) -> list:
    if isinstance(x, list | tuple):
        return [y for v in x for y in _flat(v)]
    return [x]


def _where(gm: torch.fx.GraphModule) -> str:
    """The model source line of the graph's first op with a stack trace (where the graph starts)."""
    for n in gm.graph.nodes:
        trace = n.meta.get("stack_trace")
        if trace:
            lines = [x.strip() for x in trace.strip().splitlines() if x.strip().startswith("File")]
            return lines[-1] if lines else ""
    return ""


@dataclass
class Call:
    graph: int
    call: int
    errors: list  # per output
    inputs: list | None = None  # kept for locate() when the call is beyond the flag

    @property
    def worst(self) -> float:
        return max(self.errors, default=0.0)


@dataclass
class Graph:
    index: int
    gm: torch.fx.GraphModule  # the eager graph, as Dynamo gave it
    where: str
    calls: list = field(default_factory=list)


class GraphDiff:
    """A `torch.compile` backend: tpuc's executable and the eager graph, side by side."""

    def __init__(
        self, options: dict | None = None, keep_inputs: bool = True, keep_above: float | None = None
    ):
        """`options`: tpuc's (no cache by default). A call's inputs are kept for `locate()` where
        `keep_inputs` and its worst error is above `keep_above` (default: its dtype's flag,
        1e-5 for float32, 1e-12 for float64; -1 keeps every call's)."""
        self.options = {"cache_dir": None} if options is None else options
        self.keep_inputs = keep_inputs
        self.keep_above = keep_above
        self.graphs: list[Graph] = []
        self.sequence: list[Call] = []  # every call, in the order they ran

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from .backend import tpu_backend

        graph = Graph(len(self.graphs), copy.deepcopy(gm), _where(gm))
        self.graphs.append(graph)
        compiled = tpu_backend(gm, example_inputs, self.options)

        def run(*args):
            got = compiled(*args)
            with torch.no_grad():
                ref = graph.gm(*args)
            errors = [rel_error(r, g) for r, g in zip(_flat(ref), _flat(got), strict=True)]
            call = Call(graph.index, len(graph.calls), errors)
            flag = self.keep_above
            if flag is None:
                tensors = [r for r in _flat(ref) if isinstance(r, torch.Tensor)]
                flag = max((REL_FLAG.get(r.dtype, 0) for r in tensors), default=0)
            if self.keep_inputs and call.worst > flag:
                call.inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            graph.calls.append(call)
            self.sequence.append(call)
            return got

        return run

    def calls(self) -> list[Call]:
        return list(self.sequence)

    def worst(self) -> Call:
        return max(self.calls(), key=lambda c: c.worst)

    def first_beyond(self, threshold: float) -> Call | None:
        """The first call, in the order they ran, whose worst error is beyond `threshold`."""
        return next((c for c in self.calls() if c.worst > threshold), None)

    def report(self, threshold: float = 0.0, file=sys.stdout) -> None:
        """Per graph: its calls' worst errors; the calls beyond `threshold` with every output's."""
        for g in self.graphs:
            worst = max((c.worst for c in g.calls), default=0.0)
            print(
                f"graph {g.index}: {len(g.gm.graph.nodes)} nodes, {len(g.calls)} calls, worst {worst:.3g}  {g.where}",
                file=file,
            )
            for c in g.calls:
                if c.worst > threshold:
                    errs = ", ".join(f"{e:.2g}" for e in c.errors)
                    print(f"  call {c.call}: worst {c.worst:.3g}  [{errs}]", file=file)

    def locate(self, call: Call, threshold: float | None = None, file=sys.stdout, show: int = 40) -> list:
        """Per node of `call`'s graph: (name, op, shape, dtype, local, carried) errors, printed
        from the first node whose local error is beyond `threshold` (default: its dtype's flag),
        `show` rows at most; returns all rows."""
        if call.inputs is None:
            raise ValueError(f"graph {call.graph} call {call.call}: inputs not kept (within the flag)")
        rows = locate(self.graphs[call.graph].gm, call.inputs, self.options)
        _print_rows(rows, threshold, file, show)
        return rows


def _all_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """A copy of `gm` that returns every intermediate tensor (those Dynamo's metadata says are
    tensors), and those nodes in the copy."""
    g = copy.deepcopy(gm)
    nodes = [
        n
        for n in g.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
        and isinstance(n.meta.get("example_value"), torch.Tensor)
    ]
    # Each value as it is right after its op: a later in-place op (relu_, iadd, copy_) would
    # otherwise hand back the mutated tensor.
    snapshots = []
    for n in nodes:
        with g.graph.inserting_after(n):
            snapshots.append(g.graph.call_function(torch.clone, (n,)))
    out = next(n for n in g.graph.nodes if n.op == "output")
    g.graph.erase_node(out)
    g.graph.output(tuple(snapshots))
    g.recompile()
    return g, nodes


def _run_node(gm, node, args, kwargs):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    raise ValueError(node.op)


def locate(gm: torch.fx.GraphModule, inputs: list, options: dict | None = None) -> list:
    """Rows (index, name, target, shape, dtype, local, carried, eager-64, tpuc-64 errors) for every tensor
    node of `gm` run by tpuc on `inputs` (see the module's docstring)."""
    from .backend import tpu_backend

    probe, nodes = _all_outputs(gm)
    compiled = torch.compile(probe, backend=lambda g, ex: tpu_backend(g, ex, options), dynamic=False)
    with torch.no_grad():
        values = compiled(*inputs)
    tpu = dict(zip([n.name for n in nodes], values, strict=True))
    eager: dict = {}  # the whole graph in eager
    mixed: dict = {}  # tpuc's values where it has them, eager's for the rest (sizes, tuples)
    rows = []
    placeholders = iter(inputs)
    with torch.no_grad():
        for i, n in enumerate(probe.graph.nodes):
            if n.op == "placeholder":
                eager[n.name] = mixed[n.name] = next(placeholders)
                continue
            if n.op == "output":
                break
            ea = torch.fx.node.map_arg(n.args, lambda a: eager[a.name])
            ek = torch.fx.node.map_arg(n.kwargs, lambda a: eager[a.name])
            eager[n.name] = _run_node(probe, n, ea, ek)
            ma = torch.fx.node.map_arg(n.args, lambda a: mixed[a.name])
            mk = torch.fx.node.map_arg(n.kwargs, lambda a: mixed[a.name])
            if n.name not in tpu:
                mixed[n.name] = _run_node(probe, n, ma, mk)
                continue
            got = tpu[n.name]
            truth = _in_float64(probe, n, *_cloned((ma, mk))) if got.dtype == torch.float32 else None
            local_ref = _run_node(probe, n, ma, mk)
            # A view or an in-place result stays what eager makes of tpuc's inputs (so that later
            # writes through views reach their base, as in the graph); any other value is tpuc's.
            mixed[n.name] = local_ref if _aliases(local_ref, (ma, mk)) else got
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            rows.append(
                (
                    i,
                    n.name,
                    f"{n.op}:{target}",
                    tuple(got.shape),
                    str(got.dtype).replace("torch.", ""),
                    rel_error(local_ref, got),
                    rel_error(eager[n.name], got),
                    None if truth is None else rel_error(truth, local_ref),
                    None if truth is None else rel_error(truth, got),
                )
            )
    return rows


def _cloned(tree):
    return torch.utils._pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, tree)


def _aliases(value, tree) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    ptr = value.untyped_storage().data_ptr()
    leaves = torch.utils._pytree.tree_leaves(tree)
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in leaves)


def _in_float64(gm, node, args, kwargs):
    """The node's op on its (tpuc) inputs with float32 tensors widened to float64: the value
    both float32 results round toward; None where the op does not run so."""

    def widen(a):
        return a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a

    args = torch.utils._pytree.tree_map(widen, args)
    kwargs = torch.utils._pytree.tree_map(widen, kwargs)
    try:
        if node.op == "call_module":
            module = copy.deepcopy(gm.get_submodule(node.target)).double()
            out = module(*args, **kwargs)
        else:
            out = _run_node(gm, node, args, kwargs)
    except Exception:  # an op that insists on float32 somewhere: no reference
        return None
    return out if isinstance(out, torch.Tensor) else None


def _print_rows(rows, threshold, file, show) -> None:
    def flag(dtype):
        return threshold if threshold is not None else REL_FLAG.get(getattr(torch, dtype, None), 0.0)

    first = next((k for k, r in enumerate(rows) if r[5] > flag(r[4])), None)
    print(
        f"{len(rows)} tensor nodes; first local error beyond the flag: "
        + (f"row {first} ({rows[first][1]})" if first is not None else "none"),
        file=file,
    )
    start = max(0, (first or 0) - 5)
    print(
        f"{'#':>4} {'node':<26} {'op':<36} {'shape':<20} {'dtype':<8} {'local':>8} {'carried':>8}"
        f" {'eager-64':>8} {'tpuc-64':>8}",
        file=file,
    )
    for r in rows[start : start + show]:
        mark = " <" if r[5] > flag(r[4]) else ""
        e64, t64 = ("-" if v is None else f"{v:.2g}" for v in r[7:9])
        print(
            f"{r[0]:>4} {r[1][:26]:<26} {r[2][:36]:<36} {str(r[3])[:20]:<20} {r[4]:<8} {r[5]:8.2g} {r[6]:8.2g}"
            f" {e64:>8} {t64:>8}{mark}",
            file=file,
        )


def compare(
    model,
    args,
    threshold: float | None = None,
    locate_call: bool = False,
    at: tuple[int, int] | None = None,
    show: int = 40,
    file=None,
) -> tuple[GraphDiff, object, object]:
    """Runs `model(*args)` in eager and through a `GraphDiff` backend, prints the final outputs'
    errors and the report, and (with `locate_call` or `at`) locates the first call beyond
    `threshold` (default: its dtype's flag) or `at`'s `(graph, call)`. Returns the diff, eager's
    and tpuc's outputs (no gradients are recorded); prints to `file` (default: stdout)."""
    file = file or sys.stdout
    with torch.no_grad():
        ref = model(*args)
    diff = GraphDiff(keep_above=threshold)  # with a threshold, every call beyond it can be located
    with torch.no_grad():
        got = torch.compile(model, backend=diff)(*args)
    errors = [rel_error(r, g) for r, g in zip(_flat(ref), _flat(got), strict=True)]
    print(f"final: {len(errors)} outputs, worst error {max(errors, default=0.0):.3g}", file=file)
    diff.report(threshold or 0.0, file=file)
    if locate_call or at:
        if at:
            call = diff.graphs[at[0]].calls[at[1]]
        elif threshold is not None:
            call = diff.first_beyond(threshold)
        else:  # the first call beyond its outputs' dtype flag: the first whose inputs were kept
            call = next((c for c in diff.calls() if c.inputs is not None), None)
        if call is None:
            print("no graph call beyond the threshold", file=file)
        else:
            print(f"\nlocating graph {call.graph} call {call.call} (worst {call.worst:.3g})", file=file)
            diff.locate(call, threshold, file=file, show=show)
    return diff, ref, got
