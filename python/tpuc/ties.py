"""Exact results for ops whose indices on tied values are whatever PyTorch's own kernel produces.

`torch.topk` on CPU selects with libstdc++'s `nth_element`/`partial_sort`: among equal values the
indices it returns (and their order) follow that algorithm, not the input order, and models depend
on them (an MoE router whose gate starts at zero scores every expert alike, and its expert choice is
decided by the tie order alone). tpuc's rule is a stable sort: equal to eager whenever the k
selected values and the one after them are all distinct, which is almost always. So each `topk` is
rewritten to select one value more, and the graph reports whether any two of those neighbours tie
(NaNs tie with NaNs): a call where one does is run again by PyTorch itself (counted in
`tpuc.stats()["eager_reruns"]`), so results always equal eager's. `sorted=False` with k*64 > n
and k > 2 returns `nth_element`'s partition order, which no sort reproduces: such a `topk` runs in
PyTorch (see `pytorch_order`). With k <= 2 it is sorted=True's order exactly: PyTorch's kernel
runs the same `nth_element(begin, begin + k - 1, end)` either way, and sorted=True only adds
`sort(begin, begin + k - 1)`, a range of at most one element (DeepSeek-style MoE routers pick
their experts with `topk(..., sorted=False)`). The same holds for `kthvalue` (quickselect: checked for another element
equal to the one selected) and for `sort(stable=False)` over more than 16 elements (introsort;
16 or fewer are insertion-sorted, which is stable): its indices come from PyTorch. Only ops whose
indices are read are concerned: values do not depend on the tie order."""

from __future__ import annotations

import operator
import threading
import warnings

import torch
import torch.fx

from . import counters

_TOPK = torch.ops.aten.topk.default
_KTHVALUE = torch.ops.aten.kthvalue.default
_SORT = torch.ops.aten.sort.default
_SORT_STABLE = torch.ops.aten.sort.stable
_MODE = torch.ops.aten.mode.default
# PyTorch's CPU `mode` sorts each row with std::sort: stable (insertion sort) up to this many
# elements, which tpuc's rule reproduces; beyond, equal values (and NaNs) land in an order only
# that sort gives.
_MODE_MAX_SIZE = 16
_warned: set[str] = set()
_warn_lock = threading.Lock()


def _args(n: torch.fx.Node, names: tuple, defaults: tuple) -> tuple:
    """`n`'s arguments in schema order (`names`), keywords and `defaults` filled in."""
    rest = zip(names[len(n.args) :], defaults[len(n.args) :], strict=True)
    return (*n.args, *(n.kwargs.get(name, d) for name, d in rest))


def _topk_args(n: torch.fx.Node) -> tuple:
    """(input, k, dim, largest, sorted) of an `aten.topk` node."""
    return _args(n, ("self", "k", "dim", "largest", "sorted"), (None, None, -1, True, True))


def _kthvalue_args(n: torch.fx.Node) -> tuple:
    """(input, k, dim, keepdim) of an `aten.kthvalue` node."""
    return _args(n, ("self", "k", "dim", "keepdim"), (None, None, -1, False))


def _dim_size(x, dim: int):
    """The size of `x`'s dim `dim` (1 for a 0-d tensor): an int, a SymInt, or None when `x`
    has no tensor metadata."""
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return val.shape[dim] if val.dim() else 1


def _static_size(n: torch.fx.Node) -> int | None:
    """Size of a topk's or kthvalue's dim when static, else None."""
    x, _k, dim = _topk_args(n)[:3] if n.target is _TOPK else _kthvalue_args(n)[:3]
    size = _dim_size(x, dim)
    return size if isinstance(size, int) else None


def _indices_read(n: torch.fx.Node) -> bool:
    """Whether the indices (output 1) of a (values, indices) op are used."""
    return any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] != 0 for u in n.users)


def _sort_args(n: torch.fx.Node) -> tuple:
    """(input, dim, stable) of an `aten.sort` node."""
    if n.target is _SORT:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", -1)
        return n.args[0], dim, False
    return n.args[0], n.kwargs.get("dim", -1), bool(n.kwargs.get("stable"))


def pytorch_order(n: torch.fx.Node) -> bool:
    """Whether `n`'s indices are in an order only PyTorch's kernel gives, whatever the values:
    a topk returning `nth_element`'s unsorted output (k > 2 and k*64 > n: with k <= 2 the kernel
    runs the same code as for sorted=True, whose extra sort covers k - 1 <= 1 element), an unstable sort of
    more than 16 elements whose indices are read, a `mode` over more than 16 elements (its index
    among equal values, and where NaNs land, follow std::sort's unstable order), or any of them
    over a dim of symbolic size. Such an op runs in PyTorch."""
    if n.op != "call_function":
        return False
    if n.target is _TOPK:
        _x, k, _dim, _largest, sorted_ = _topk_args(n)
        size = _static_size(n)
        if size is None or not isinstance(k, int):
            return True
        return not sorted_ and k > 2 and k * 64 > size
    if n.target in (_SORT, _SORT_STABLE):
        x, dim, stable = _sort_args(n)
        if stable or not _indices_read(n):
            return False
        size = _dim_size(x, dim)
        return size is not None and (not isinstance(size, int) or size > 16)
    if n.target is _MODE:
        x = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", -1)
        size = _dim_size(x, dim)
        return size is not None and (not isinstance(size, int) or size > _MODE_MAX_SIZE)
    return False


def _fake_mode(gm: torch.fx.GraphModule):
    vals = [n.meta.get("val") for n in gm.graph.nodes]
    return torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def checked_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The topk and kthvalue nodes of `gm` whose indices are read and could tie."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in (_TOPK, _KTHVALUE)
        and _indices_read(n)
        and not pytorch_order(n)
        and _static_size(n) is not None
        and (n.target is _KTHVALUE or min(_topk_args(n)[1] + 1, _static_size(n)) > 1)
    ]


def add_tie_checks(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> int:
    """Rewrites `gm` (in place) so that it also returns, per topk or kthvalue whose indices are
    read, a bool: whether the values it selected could tie (topk: it selects one value more and
    compares neighbours; kthvalue: another element equals the one selected). Returns the number
    of outputs added (0: `gm` is unchanged). `nodes`: `checked_nodes(gm)`."""
    if not nodes:
        return 0
    fake_mode = _fake_mode(gm)
    graph = gm.graph
    aten = torch.ops.aten
    flags = []
    anchor = None

    def call(target, *args):
        nonlocal anchor
        with graph.inserting_after(anchor):
            node = graph.call_function(target, args)
        fake_args = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*fake_args)
        anchor = node
        return node

    def equal_or_both_nan(a, b):
        tie = call(aten.eq.Tensor, a, b)
        if a.meta["val"].is_floating_point():
            both = call(aten.logical_and.default, call(aten.isnan.default, a), call(aten.isnan.default, b))
            tie = call(aten.logical_or.default, tie, both)
        return tie

    for n in nodes:
        anchor = n
        if n.target is _KTHVALUE:
            x, _k, dim, keepdim = _kthvalue_args(n)
            value = call(operator.getitem, n, 0)
            if not keepdim and x.meta["val"].dim():
                value = call(aten.unsqueeze.default, value, dim)
            same = call(aten.sum.dim_IntList, equal_or_both_nan(x, value), [dim])
            flags.append(call(aten.any.default, call(aten.gt.Scalar, same, 1)))
            continue
        x, k, dim, largest, _sorted = _topk_args(n)
        wide = min(k + 1, _static_size(n))
        dim = dim % max(x.meta["val"].dim(), 1)
        selected = call(_TOPK, x, wide, dim, largest, True)
        values_all = call(operator.getitem, selected, 0)
        indices_all = call(operator.getitem, selected, 1)
        values = call(aten.slice.Tensor, values_all, dim, 0, k)
        indices = call(aten.slice.Tensor, indices_all, dim, 0, k)
        a = call(aten.slice.Tensor, values_all, dim, 0, wide - 1)
        b = call(aten.slice.Tensor, values_all, dim, 1, wide)
        flags.append(call(aten.any.default, equal_or_both_nan(a, b)))
        # The old topk's users read values and indices through getitem.
        for user in list(n.users):
            user.replace_all_uses_with(values if user.args[1] == 0 else indices)
            graph.erase_node(user)
        graph.erase_node(n)
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
                f"tpuc: graph {self.name} ran in eager PyTorch for a call where torch.topk or "
                "kthvalue selected tied values: which indices they return is PyTorch's own kernel's",
                stacklevel=2,
            )
        return list(self.eager(*args))
