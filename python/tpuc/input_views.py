"""Inputs and outputs that are views: returned and taken as PyTorch holds them.

Outputs that are inputs, or views of inputs (the IR's `Output::Input`; `split`, `WithInputViews`):

AOTAutograd's training forward graphs return, among the activations saved for the backward,
the parameters themselves and views of them (GPT-2: every weight matrix, and the transposed
[768, 50257] embedding its LM head reads: 680 MB of outputs per step). Returned by the compiled
program, each would be a fresh copy written on every call. Eager PyTorch and Inductor save the
parameter or the view itself, so here these outputs leave the compiled graph and are made at
call time from the inputs: the input tensor (the compiled graph itself returns the caller's
tensor for an output that is an input: no output of the executable, no wrapper), or the same
chain of view ops replayed on it (`split`; no data moves). Same values, and the same aliasing as
eager and Inductor (autograd's saved-tensor version checks see in-place writes between forward
and backward).

Inputs that arrive as a permutation of a dense tensor (`declare_storage_order`,
`storage_order_inputs`, `PermutedArgs`): the transposed embedding GPT-2's backward reads (a
view the forward saved), the channels-last activations of handoff.py. The graph takes the dense
tensor in its storage order and permutes it back itself, which lowering folds into the ops that
read it (a dot's dimension numbers, a convolution's layout); the call passes the permuted view,
contiguous, where a row-major copy would otherwise be made on every call.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# View ops replayed on the input at call time: they never copy (a `view` that could not be a
# view failed at trace time already, on tensors with the same strides as the call's).
VIEW_OPS = {
    aten.alias.default,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.select.int,
    aten.slice.Tensor,
}


def _chain(node: torch.fx.Node, placeholders: dict) -> tuple[int, list] | None:
    """(input index, [(op, args after the tensor, kwargs)] from the input to `node`) when `node`
    is an input or a chain of view ops on one, with constant arguments; else None."""
    ops = []
    while node.op != "placeholder":
        if node.op != "call_function" or node.target not in VIEW_OPS or not node.args:
            return None
        rest = node.args[1:]
        if not isinstance(node.args[0], torch.fx.Node) or _traced(rest) or _traced(node.kwargs):
            return None
        ops.append((node.target, rest, dict(node.kwargs)))
        node = node.args[0]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or node not in placeholders:
        return None
    return placeholders[node], ops[::-1]


def _traced(args) -> bool:
    """Whether `args` hold graph values or symbolic sizes (not replayable as constants)."""
    found = []
    torch.fx.node.map_aggregate(
        args, lambda a: found.append(a) if isinstance(a, (torch.fx.Node, torch.SymInt)) else a
    )
    return bool(found)


def graph_outputs(gm: torch.fx.GraphModule) -> list:
    """What `gm` returns, one entry per output position."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else []


def _view_chains(gm: torch.fx.GraphModule) -> dict[int, tuple[int, list]]:
    """{output position: (input index, view ops)} of the outputs of `gm` that are inputs the
    graph does not write, or views of them."""
    placeholders = _unmutated_placeholders(gm)
    chains = {}
    for pos, o in enumerate(graph_outputs(gm)):
        if isinstance(o, torch.fx.Node) and (chain := _chain(o, placeholders)) is not None:
            chains[pos] = chain
    return chains


def split(gm: torch.fx.GraphModule) -> dict[int, tuple[int, list]]:
    """Takes the outputs of `gm` that are views of inputs out of its output tuple. Returns
    {original output position: (input index, view ops)}; `gm` is left untouched when there are
    none. An output that is an input itself stays: the compiled graph returns the caller's
    tensor for it without a wrapper (`Output::Input` in the IR, the call plan's "input")."""
    taken = {pos: chain for pos, chain in _view_chains(gm).items() if chain[1]}
    if taken:
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        outs = out.args[0]
        out.args = (type(outs)(o for pos, o in enumerate(outs) if pos not in taken),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return taken


class WithInputViews:
    """A boxed compiled graph whose outputs at the positions of `taken` (see `split`) are made
    from its inputs at call time."""

    _boxed_call = True

    def __init__(self, inner, taken: dict[int, tuple[int, list]]):
        self.inner = inner
        self.taken = sorted(taken.items())

    def __call__(self, args):
        # Before the call: a boxed callee may clear `args`.
        made = []
        for pos, (index, ops) in self.taken:
            t = args[index]
            for op, rest, kwargs in ops:
                t = op(t, *rest, **kwargs)
            made.append((pos, t))
        outs = list(self.inner(args))
        for pos, t in made:
            outs.insert(pos, t)
        return outs


def remap_positions(taken: dict, positions: list[int]) -> tuple[list[int], dict[int, int]]:
    """Output `positions` of the original graph as positions of the split one (those taken out
    are dropped), and the split graph's positions back to the original ones."""
    kept = [p for p in range(max(positions, default=-1) + 1) if p not in taken]
    new_of = {old: new for new, old in enumerate(kept)}
    mapped = [new_of[p] for p in positions if p in new_of]
    return mapped, {new: old for old, new in new_of.items()}


def dense_order(val) -> list[int] | None:
    """The dim order in which non-contiguous `val` fills its storage densely from offset 0 (a
    permutation of its dims, not the identity), or None."""
    if not isinstance(val, torch.Tensor) or val.ndim < 2:
        return None
    try:
        # Symbolic sizes never compared: a comparison adds a guard on them (GPT-2's storage of
        # `8*s` bytes against 16 broke a declared range min=2 of the token dim).
        if any(type(d) is not int for d in (*val.shape, *val.stride(), val.storage_offset())):
            return None
        if val.is_contiguous() or val.storage_offset() != 0:
            return None
        nbytes = val.untyped_storage().nbytes()
        if type(nbytes) is not int or nbytes != val.numel() * val.element_size():
            return None
    except Exception:  # no storage (sparse, nested)
        return None
    order = sorted(range(val.ndim), key=lambda d: (-val.stride(d), d))
    return order if val.permute(order).is_contiguous() else None


def declare_storage_order(gm: torch.fx.GraphModule, ph: torch.fx.Node, order) -> None:
    """Makes placeholder `ph` take its tensor permuted by `order` (dense, row-major), read
    through the inverse permute by its users."""
    val = ph.meta["val"]
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    users = list(ph.users)
    with gm.graph.inserting_after(ph):
        back = gm.graph.call_function(aten.permute.default, (ph, inverse))
    back.meta["val"] = val
    for u in users:
        u.replace_input_with(ph, back)
    ph.meta["val"] = val.permute(list(order)).contiguous()
    ph.meta.pop("tensor_meta", None)  # the traced layout: `val` is read instead


def _unmutated_placeholders(gm: torch.fx.GraphModule) -> dict:
    """{placeholder: input position} of the inputs no op of `gm` writes (an in-graph `copy_`
    of an input mutation would change a view replayed after the call)."""
    written = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            for a in n.args:
                # Through views to the tensor they alias.
                while isinstance(a, torch.fx.Node):
                    written.add(a)
                    a = a.args[0] if a.op == "call_function" and a.target in VIEW_OPS and a.args else None
    ordered = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n: i for i, n in enumerate(ordered) if n not in written}


def view_outputs(gm: torch.fx.GraphModule) -> set[str]:
    """The names of the outputs of `gm` that `split` would take out (inputs and their views)."""
    outs = graph_outputs(gm)
    return {outs[pos].name for pos in _view_chains(gm)}


def storage_order_inputs(gm: torch.fx.GraphModule, names: set[str]) -> dict[int, list[int]]:
    """Declares each placeholder named in `names` that was traced as a permuted dense tensor in
    its storage order (see `declare_storage_order`). Only for inputs whose traced strides are
    the call's: the views `WithInputViews` returns (tpuc's own outputs are row-major whatever
    the trace says). Returns {input position: order}."""
    found = {}
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        order = dense_order(ph.meta.get("val")) if ph.name in names else None
        if order is not None and ph.users:
            declare_storage_order(gm, ph, order)
            found[i] = order
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


class PermutedArgs:
    """A boxed compiled graph whose args at the positions of `orders` are passed permuted (see
    `declare_storage_order`): a free view when they arrive with the strides the graph was
    compiled for, else the call's general path copies them into that order."""

    _boxed_call = True

    def __init__(self, inner, orders: dict[int, list[int]]):
        self.inner = inner
        self.orders = sorted(orders.items())

    def __call__(self, args):
        for i, order in self.orders:
            args[i] = args[i].permute(order)
        return self.inner(args)
