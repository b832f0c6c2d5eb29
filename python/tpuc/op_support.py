"""Which FX nodes tpuc lowers (the native module's rules, for the dtypes and operands they were
checked on), and why a node is not lowered, for error messages."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from . import _native, ties
from .dtypes import _DTYPE_NAMES
from .storage_ops import _STORAGE_OPS, _owns_dense_storage

_supported_ops = frozenset(_native.supported_ops())


def _is_tensor_op(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    return n.op == "call_function" and not isinstance(val, torch.SymInt | int | torch.SymFloat | float)


def _representable(val) -> bool:
    """Whether tpuc can type a value: supported dtypes, and no data-dependent (unbacked) sizes."""
    if isinstance(val, list | tuple):
        return all(_representable(v) for v in val)
    if isinstance(val, torch.Tensor):
        return val.dtype in _DTYPE_NAMES and not free_unbacked_symbols(val)
    return True


# Ops whose lowering rules are checked on complex tensors (tests/test_linalg_complex.py); any other
# op touching a complex tensor runs in PyTorch (or raises with fallback="error"), since rules
# written for real dtypes may not know complex semantics (abs, division, sign ...).
_COMPLEX_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "_conj.default _conj_physical.default conj_physical.default view_as_real.default "
        "view_as_complex.default complex.default polar.default real.default imag.default "
        "_fft_r2c.default _fft_c2c.default _fft_c2r.default _to_copy.default clone.default "
        "alias.default view.default _unsafe_view.default permute.default expand.default "
        "slice.Tensor select.int squeeze.dim squeeze.dims unsqueeze.default cat.default "
        "constant_pad_nd.default flip.default tril.default triu.default where.self "
        "add.Tensor sub.Tensor mul.Tensor neg.default exp.default log.default log1p.default "
        "sqrt.default rsqrt.default sin.default tanh.default reciprocal.default "
        "pow.Tensor_Scalar sum.dim_IntList sum.default mean.dim mean.default prod.dim_int cumsum.default "
        "mm.default bmm.default eq.Tensor ne.Tensor isnan.default sigmoid.default "
        "scalar_tensor.default full_like.default "
        # Data movement, whose rules never look at the element type (Lumina2's complex rotary
        # frequencies are repeated, gathered and copied, QwenImage's split;
        # tests/test_sweep_diffusers.py).
        "repeat.default gather.default full.default copy.default split_with_sizes.default "
        "split.Tensor index.Tensor index_select.default"
    ).split()
)


def _op_name(n: torch.fx.Node) -> str:
    """The name tpuc's rules know the node's op by: `str(target)` (`aten.add.Tensor`), and
    `higher_order.cond` for PyTorch's control-flow operators (whose `str` is `cond`)."""
    if isinstance(n.target, torch._ops.HigherOrderOperator):
        return f"higher_order.{n.target}"
    return str(n.target)


def _graphs_of(n: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graphs a control-flow node runs (its `get_attr` arguments naming GraphModules)."""
    owner = n.graph.owning_module
    graphs = []
    for a in n.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(owner, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                graphs.append(sub)
    return graphs


def _control_flow_supported(n: torch.fx.Node) -> bool:
    """A control-flow node is lowered when tpuc has its rule and lowers every op of the graphs
    it runs (nested control flow included), and none of them is a topk/kthvalue whose indices
    could tie: the tie check (ties.py) reruns a whole graph in PyTorch, which a loop body is
    not."""
    return _op_name(n) in _supported_ops and all(
        not _unsupported_nodes(g) and not ties.checked_nodes(g) for g in _graphs_of(n)
    )


def _supported(n: torch.fx.Node) -> bool:
    if n.op == "get_attr":
        # A control-flow op's graph goes into the partition of the op that runs it.
        graph = getattr(n.graph.owning_module, n.target, None)
        return (
            isinstance(graph, torch.fx.GraphModule) and bool(n.users) and all(_supported(u) for u in n.users)
        )
    if n.op != "call_function":
        return False
    if not _is_tensor_op(n):
        return False
    if not _representable(n.meta.get("val")):
        return False
    if isinstance(n.target, torch._ops.HigherOrderOperator):
        return _control_flow_supported(n)
    target = str(n.target)
    if target in _STORAGE_OPS and not _owns_dense_storage(n.args[0]):
        return False
    if ties.pytorch_order(n):
        return False
    leaves: list = []
    torch.fx.node.map_aggregate((n.args, n.kwargs), leaves.append)
    vals = [n.meta.get("val"), *(a.meta.get("val") for a in leaves if isinstance(a, torch.fx.Node))]
    tensors = [
        t for v in vals for t in (v if isinstance(v, list | tuple) else [v]) if isinstance(t, torch.Tensor)
    ]
    if target != "aten.hash_tensor.default" and any(t.dtype == torch.uint64 for t in tensors):
        return False  # uint64 is only lowered as hash_tensor's result
    if (
        target not in _COMPLEX_OPS
        and n.target is not operator.getitem
        and any(t.is_complex() for t in tensors)
    ):
        return False
    if any(isinstance(a, complex) for a in leaves):
        return False  # complex Python scalars have no wire format (complex tensors do)
    if target == "prims.fma.default" and any(t.dtype == torch.float64 for t in tensors):
        return False  # rounded once through a wider type, and float64 has none (elementwise.rs)
    return target in _supported_ops or n.target.__name__ == "getitem"


def _why_unsupported(n: torch.fx.Node) -> str:
    """The reason `_supported` gives for `n`, for error messages."""
    target = _op_name(n)
    if isinstance(n.target, torch._ops.HigherOrderOperator) and target in _supported_ops:
        inner = [
            f"`{m.target}` (node `{m.name}`)"
            for g in _graphs_of(n)
            for m in [*_unsupported_nodes(g), *ties.checked_nodes(g)]
        ]
        return (
            "tpuc does not lower every op of the graphs it runs (ops without a rule, or topk/"
            "kthvalue indices that could tie): " + ", ".join(inner)
        )
    if ties.pytorch_order(n):
        return (
            "its indices are in an order only PyTorch's own kernel gives (topk sorted=False, "
            "unstable sort or mode of more than 16 elements, or a dim of symbolic size)"
        )
    if target in _supported_ops:
        leaves: list = []
        torch.fx.node.map_aggregate((n.args, n.kwargs), leaves.append)
        if any(isinstance(a, complex) for a in leaves):
            return "tpuc cannot pass complex Python scalars yet"
        if target == "prims.fma.default":
            return "tpuc rounds fma exactly once through a wider type, and float64 has none"
        return "tpuc does not lower it for these operands (complex or uint64 tensors, data-dependent sizes)"
    return "tpuc has no lowering rule for it"


def _unsupported_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if _is_tensor_op(n) and not _supported(n)]
