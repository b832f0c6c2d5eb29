"""Ops that address a tensor's storage rather than its view (`as_strided`): when tpuc's dense
row-major values compute them exactly, and pointing them at the node that owns the storage."""

from __future__ import annotations

import torch
import torch.fx

from . import input_views

_STORAGE_OPS = frozenset({"aten.as_strided.default", "aten.as_strided_scatter.default"})


def _owns_dense_storage(arg) -> bool:
    """Whether `arg`'s storage is exactly its elements in row-major order. tpuc values are dense
    row-major arrays, so ops that address the storage (as_strided) are only exact then."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    return (
        val.is_contiguous()
        and val.storage_offset() == 0
        and val.untyped_storage().nbytes() == val.numel() * val.element_size()
    )


def _static_layout(val) -> bool:
    """Whether a tensor's sizes, strides and storage offset are plain ints: asking a symbolic
    one about its layout would add guards that specialize dynamic dims."""
    if not isinstance(val, torch.Tensor):
        return False
    try:
        dims = (*val.shape, *val.stride(), val.storage_offset())
    except Exception:  # no strides (sparse, nested)
        return False
    return all(type(d) is int for d in dims)


def _storage_key(val: torch.Tensor):
    try:
        return val.untyped_storage()._cdata
    except Exception:  # a tensor without storage (sparse, nested): never matched
        return None


def _rebase_storage_ops(gm: torch.fx.GraphModule) -> int:
    """Points each `as_strided` whose operand is a view that is not its own dense storage (a
    strided slice, a view with an offset, a permuted view ...) at the graph node that owns that
    storage densely (the node the view was taken from, through any chain of views), with the
    view's storage offset made explicit. as_strided addresses the storage, not the view, so the
    result is the same, and the owner is a dense row-major array as tpuc holds every value: the
    op lowers exactly (a reshape or a gather) instead of running in PyTorch on a dense copy of the
    view, whose storage is not the one eager PyTorch addressed (Longformer's chunked attention).
    Returns the number of ops rewritten."""
    owners: dict = {}
    permuted: dict = {}  # storage -> (node, dim order) of values that fill it in a permuted order
    changed = 0
    for n in list(gm.graph.nodes):
        val = n.meta.get("val")
        if not _static_layout(val):
            continue  # symbolic layouts are left alone (and as_strided over them falls back)
        if str(n.target) == "aten.as_strided.default" and isinstance(n.args[0], torch.fx.Node):
            x = n.args[0]
            xval = x.meta.get("val")
            if not _static_layout(xval):
                continue
            key = _storage_key(xval) if isinstance(xval, torch.Tensor) else None
            base = owners.get(key)
            if base is None and key in permuted and not _owns_dense_storage(x):
                # The storage is a permuted dense tensor's (a clone of a transposed view keeps
                # its strides): its permutation into storage order is a dense row-major array.
                owner, order = permuted[key]
                with gm.graph.inserting_before(n):
                    base = gm.graph.call_function(torch.ops.aten.permute.default, (owner, order))
                base.meta["val"] = owner.meta["val"].permute(order)
                owners[key] = base
            if base is not None and base is not x and not _owns_dense_storage(x):
                size, stride = n.args[1], n.args[2]
                offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
                if offset is None:
                    offset = xval.storage_offset()
                if base.meta["val"].dtype == xval.dtype and isinstance(offset, int):
                    n.args = (base, size, stride, offset)
                    n.kwargs = {}
                    changed += 1
        key = _storage_key(val)
        if key is None:
            continue
        if _owns_dense_storage(n):
            owners.setdefault(key, n)
        elif (order := input_views.dense_order(val)) is not None:
            permuted.setdefault(key, (n, order))
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
