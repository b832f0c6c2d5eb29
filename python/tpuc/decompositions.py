"""The decompositions AOTAutograd traces with for tpuc: PyTorch's core ATen table (minus a wrong
one), with bucketing the compound reductions the bucketing pass can mask, and tpuc's own
static-shape forms of `torch._grouped_mm` and `index_put` (boolean masks; with bucketing, writes
along one dim as selects), and the foreach norm and product of `clip_grad_norm_` per tensor."""

from __future__ import annotations

import torch
import torch.fx
from torch._decomp import core_aten_decompositions

# Core ATen decompositions, minus one that is wrong in torch 2.15: the CPU flash-attention
# decomposition returns the attention weights where the op's second result is the logsumexp.
_DECOMPOSITIONS = {
    **{
        op: fn
        for op, fn in core_aten_decompositions().items()
        if op is not torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    },
    # The backward of `_batch_norm_with_update` (training BatchNorm as export traces it), which
    # the core table keeps whole: PyTorch's own decomposition (to native_batch_norm_backward's).
    **torch._decomp.get_decompositions([torch.ops.aten.batch_norm_backward]),
}
# With bucketing, compound ops that reduce over a (possibly padded) batch or sequence dim are
# decomposed into primitive reductions, which the bucketing pass knows how to mask.
_BUCKET_DECOMPOSITIONS = {
    **_DECOMPOSITIONS,
    **torch._decomp.get_decompositions(
        [
            torch.ops.aten.native_layer_norm_backward,
            torch.ops.aten.native_batch_norm_backward,
            torch.ops.aten._native_batch_norm_legit_functional,
            torch.ops.aten._native_batch_norm_legit,
            torch.ops.aten.native_batch_norm,
            torch.ops.aten.native_group_norm_backward,
            torch.ops.aten.nll_loss_forward,
            torch.ops.aten.nll_loss_backward,
        ]
    ),
}


def _grouped_mm(
    mat1: torch.Tensor, mat2: torch.Tensor, offs: torch.Tensor | None = None, bias=None, out_dtype=None
):
    """`torch._grouped_mm` for a 2-d `mat1` (rows sorted by group) and a 3-d `mat2` (one matrix
    per group, `offs` the groups' cumulative row ends), in ops with static shapes: the product
    of every row with every group's matrix, then each row's own group selected (rows past the
    last end are zero, as in transformers' `grouped_mm_fallback`), equal to the kernel's to
    float rounding (each row is the same dot product, summed in XLA's order). The cost is one
    product per group (fine for MoE inference with few experts or few tokens). Other layouts keep
    the op (unsupported: it falls back)."""
    if (
        mat1.dim() != 2
        or mat2.dim() != 3
        or offs is None
        or bias is not None
        or out_dtype not in (None, mat1.dtype)
    ):
        return NotImplemented
    rows = torch.arange(mat1.shape[0], device=mat1.device, dtype=offs.dtype)
    group = (rows.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)  # each row's group; E past the end
    every = torch.einsum("sk,ekn->esn", mat1, mat2)
    index = group.clamp(max=mat2.shape[0] - 1).view(1, -1, 1).expand(1, mat1.shape[0], mat2.shape[2])
    picked = torch.take_along_dim(every, index, dim=0).squeeze(0)
    return torch.where((group < mat2.shape[0]).unsqueeze(1), picked, torch.zeros((), dtype=picked.dtype))


_DECOMPOSITIONS[torch.ops.aten._grouped_mm.default] = _grouped_mm
_BUCKET_DECOMPOSITIONS[torch.ops.aten._grouped_mm.default] = _grouped_mm


def _foreach_norm(tensors, ord=2, dtype=None):
    """`torch._foreach_norm` (clip_grad_norm_ under torch.compile) as one vector norm per
    tensor, which is what PyTorch's CPU kernel computes too (its per-tensor path)."""
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def _foreach_mul(tensors, other):
    """`torch._foreach_mul` (clip_grad_norm_'s scaling) as one product per tensor, as PyTorch's
    CPU kernel computes it; `other` a scalar, a tensor or a list of them."""
    if isinstance(other, list | tuple):
        return [t * o for t, o in zip(tensors, other, strict=True)]
    return [t * other for t in tensors]


for _table in (_DECOMPOSITIONS, _BUCKET_DECOMPOSITIONS):
    _table[torch.ops.aten._foreach_norm.Scalar] = _foreach_norm
    for _overload in ("Scalar", "Tensor", "List"):
        _table[getattr(torch.ops.aten._foreach_mul, _overload)] = _foreach_mul


def _index_put_by_select(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    """A non-accumulating `index_put` along one dim (`target[..., idx, ...] = values`: a static
    cache's KV write, `index_copy_`) as selects: which target rows `idx` names, the first value
    naming each, and `where`. Used with bucketing only: the bucketing pass masks these ops
    exactly (a padded `idx` entry matches no row), while a write with padded indices would land
    on a real row. Costs len(idx) x rows comparisons; duplicate indices (whose winner PyTorch
    leaves unspecified) take the first. Other forms keep the op."""
    live = [i for i, t in enumerate(indices) if t is not None]
    if accumulate or len(live) != 1 or values.dim() != target.dim():
        return NotImplemented
    d = live[0]
    idx = indices[d]
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32) or idx.dtype == torch.bool:
        return NotImplemented
    rows = target.shape[d]
    idx = torch.where(idx < 0, idx + rows, idx)
    match = idx.unsqueeze(1) == torch.arange(rows, dtype=idx.dtype, device=idx.device)  # (len, rows)
    hit = match.any(0)
    picked = values if values.shape[d] == 1 else values.index_select(d, match.to(torch.int32).argmax(0))
    shape = [1] * target.dim()
    shape[d] = rows
    return torch.where(hit.view(shape), picked.to(target.dtype), target)


for _op in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
    _BUCKET_DECOMPOSITIONS[_op] = _index_put_by_select


def _index_put_by_mask(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    """`index_put` whose one index is a boolean mask (`x[mask] = values`, `x[:, mask] += v`), in
    ops with static shapes: each True position's rank among the True positions (a cumulative
    sum) picks its value, `where` writes it. The values' count along the mask's dim must equal
    the number of True elements, which only the data knows: a `_assert_async` checks it (tpuc
    checks it on the host after the call), so a mismatch raises instead of writing clamped or
    unused values. A mask followed by other indices keeps the op."""
    live = [i for i, t in enumerate(indices) if t is not None]
    if len(live) != 1 or indices[live[0]].dtype != torch.bool:
        return NotImplemented
    k = live[0]
    mask = indices[k]
    r = mask.dim()
    if tuple(mask.shape) != tuple(target.shape[k : k + r]):
        return NotImplemented
    rest = list(target.shape[k + r :])
    result = [*target.shape[:k], -1, *rest]  # the indexing result's shape, N = the True count
    if values.dim() > len(result):
        return NotImplemented
    vshape = [1] * (len(result) - values.dim()) + list(values.shape)
    n = vshape[k]
    flat = mask.reshape(-1)
    m = flat.shape[0]
    if n == 1:  # one value broadcast to every True position
        picked = (
            values.reshape(vshape).expand([*target.shape[:k], 1, *rest]).expand([*target.shape[:k], m, *rest])
        )
    else:
        torch._assert_async(
            flat.sum() == n,
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
            f"the indexing result (the boolean mask's number of True elements is not {n})",
        )
        if n == 0:  # no values (an all-False mask, checked above): nothing is written
            return target.clone()
        rank = (torch.cumsum(flat.to(torch.int64), 0) - 1).clamp(0, n - 1)
        full = values.reshape(vshape).expand([*target.shape[:k], n, *rest])
        picked = full.index_select(k, rank)
    picked = picked.reshape(target.shape).to(target.dtype)
    where = mask.reshape([1] * k + list(mask.shape) + [1] * len(rest))
    if accumulate:
        return target + torch.where(where, picked, torch.zeros((), dtype=target.dtype))
    return torch.where(where, picked, target)


def _index_put(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    return _index_put_by_mask(target, indices, values, accumulate)


def _bucket_index_put(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    out = _index_put_by_mask(target, indices, values, accumulate)
    return out if out is not NotImplemented else _index_put_by_select(target, indices, values, accumulate)


for _op in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
    _DECOMPOSITIONS[_op] = _index_put
    _BUCKET_DECOMPOSITIONS[_op] = _bucket_index_put


# PyTorch's control-flow operators (torch.ops.higher_order.*) that tpuc lowers.
CONTROL_FLOW_OPS = frozenset(("cond", "while_loop", "scan", "map_impl"))


def has_control_flow(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo's graph calls one of PyTorch's control-flow operators."""
    return any(
        n.op == "call_function"
        and isinstance(n.target, torch._ops.HigherOrderOperator)
        and str(n.target) in CONTROL_FLOW_OPS
        for n in gm.graph.nodes
    )


def _decompositions(bucketed: bool, control_flow: bool = False) -> dict:
    """The decomposition table, plus transformers' opaque MoE expert product
    (`transformers::grouped_mm_fallback`: a Python loop over the groups with a host sync, which
    transformers uses under torch.compile where `torch._grouped_mm` has no kernel, e.g. float32
    on CPU) once transformers has registered it: it is `torch._grouped_mm` without bias.
    `control_flow` (the graph calls `torch.cond`, `scan` ...): without the core table's
    `detach -> alias`, which makes PyTorch's own check refuse to differentiate a scan ("scan
    might be aliasing the input or the output"); `detach` is then traced as `detach_copy`
    inside the bodies (lowered as the identity)."""
    table = _BUCKET_DECOMPOSITIONS if bucketed else _DECOMPOSITIONS
    if control_flow:
        table = {op: fn for op, fn in table.items() if op is not torch.ops.aten.detach.default}
    try:
        op = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):
        return table
    return {**table, op: _grouped_mm}
