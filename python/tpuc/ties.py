"""Exact results for ops whose answer on tied values is whatever PyTorch's own kernel produces.

`torch.topk` on CPU selects with libstdc++'s `nth_element`/`partial_sort`: among equal values the
indices it returns (and their order) follow that algorithm, not the input order, and models depend
on them (an MoE router whose gate starts at zero scores every expert alike, and its expert choice is
decided by the tie order alone). tpuc's rule is a stable sort: equal to eager whenever the k
selected values and the one after them are all distinct, which is almost always. So each `topk` is
rewritten to select one value more, and the graph reports whether any two of those neighbours tie
(NaNs tie with NaNs): a call where one does is run again by PyTorch itself (counted in
`tpuc.stats()["eager_reruns"]`), so results always equal eager's. `sorted=False` with k*64 > n
returns `nth_element`'s partition order, which no sort reproduces: such a `topk` runs in PyTorch
(see `unordered_topk`)."""

from __future__ import annotations

import operator
import threading
import warnings

import torch
import torch.fx

from . import counters

_TOPK = torch.ops.aten.topk.default
_warned: set[str] = set()
_warn_lock = threading.Lock()


def _topk_args(n: torch.fx.Node) -> tuple:
    """(input, k, dim, largest, sorted) of an `aten.topk` node, defaults filled in."""
    names = ("self", "k", "dim", "largest", "sorted")
    defaults = (None, None, -1, True, True)
    rest = zip(names[len(n.args) :], defaults[len(n.args) :], strict=True)
    return (*n.args, *(n.kwargs.get(name, d) for name, d in rest))


def _static_size(n: torch.fx.Node) -> int | None:
    """Size of the selected dim when static, else None."""
    x, _k, dim, _largest, _sorted = _topk_args(n)
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    size = val.shape[dim] if val.dim() else 1
    return size if isinstance(size, int) else None


def unordered_topk(n: torch.fx.Node) -> bool:
    """Whether `n` is a topk whose order only PyTorch's kernel gives: unsorted output of
    `nth_element` (k > 1 and k*64 > n), or a dim of symbolic size (whether it is may depend on
    the size)."""
    if n.op != "call_function" or n.target is not _TOPK:
        return False
    _x, k, _dim, _largest, sorted_ = _topk_args(n)
    size = _static_size(n)
    if size is None or not isinstance(k, int):
        return True
    return not sorted_ and k > 1 and k * 64 > size


def _fake_mode(gm: torch.fx.GraphModule):
    vals = [n.meta.get("val") for n in gm.graph.nodes]
    return torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def add_tie_checks(gm: torch.fx.GraphModule) -> int:
    """Rewrites every topk of `gm` (in place) to select one value more and appends one bool
    output per topk: whether any neighbours among its selected values and the next tie. Returns
    the number of outputs added (0: `gm` is unchanged)."""
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target is _TOPK
        and not unordered_topk(n)
        and min(_topk_args(n)[1] + 1, _static_size(n)) > 1  # else nothing can tie
    ]
    if not nodes:
        return 0
    fake_mode = _fake_mode(gm)
    graph = gm.graph
    aten = torch.ops.aten
    flags = []

    def call(target, args, anchor):
        with graph.inserting_after(anchor):
            node = graph.call_function(target, args)
        fake_args = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*fake_args)
        return node

    for n in nodes:
        x, k, dim, largest, _sorted = _topk_args(n)
        size = _static_size(n)
        wide = min(k + 1, size)
        dim = dim % max(x.meta["val"].dim(), 1)
        selected = call(_TOPK, (x, wide, dim, largest, True), n)
        values_all = call(operator.getitem, (selected, 0), selected)
        indices_all = call(operator.getitem, (selected, 1), values_all)
        values = call(aten.slice.Tensor, (values_all, dim, 0, k), indices_all)
        indices = call(aten.slice.Tensor, (indices_all, dim, 0, k), values)
        a = call(aten.slice.Tensor, (values_all, dim, 0, wide - 1), indices)
        b = call(aten.slice.Tensor, (values_all, dim, 1, wide), a)
        tie = call(aten.eq.Tensor, (a, b), b)
        if values_all.meta["val"].is_floating_point():
            nan_a = call(aten.isnan.default, (a,), tie)
            nan_b = call(aten.isnan.default, (b,), nan_a)
            both = call(aten.logical_and.default, (nan_a, nan_b), nan_b)
            tie = call(aten.logical_or.default, (tie, both), both)
        flag = call(aten.any.default, (tie,), tie)
        # The old topk's users read values and indices through getitem.
        for user in list(n.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(values if user.args[1] == 0 else indices)
                graph.erase_node(user)
        if n.users:
            n.replace_all_uses_with(selected)  # pragma: no cover (topk is only read via getitem)
        graph.erase_node(n)
        flags.append(flag)
    out = next(n for n in graph.nodes if n.op == "output")
    outs = out.args[0]
    out.args = ((*outs, *flags),) if isinstance(outs, list | tuple) else ((outs, *flags),)
    graph.lint()
    gm.recompile()
    return len(flags)


class TieChecked:
    """Runs a compiled graph whose topks report ties (see `add_tie_checks`); a call where one
    tied is run again by `eager` (the graph as PyTorch runs it), so its result is PyTorch's."""

    _boxed_call = True

    def __init__(self, inner, n_flags: int, eager, name: str):
        self.inner, self.n_flags, self.eager, self.name = inner, n_flags, eager, name

    def __call__(self, args):
        args = list(args)
        outs = list(self.inner(list(args)))
        k = len(outs) - self.n_flags
        if not any(bool(flag) for flag in outs[k:]):
            return outs[:k]
        counters.add(eager_reruns=1)
        with _warn_lock:
            first = self.name not in _warned
            _warned.add(self.name)
        if first:
            warnings.warn(
                f"tpuc: graph {self.name} ran in eager PyTorch for a call where torch.topk had tied "
                "values: which of them it returns is decided by PyTorch's own kernel",
                stacklevel=2,
            )
        return list(self.eager(*args))
