"""FlexAttention (`torch.nn.attention.flex_attention`) as plain ATen ops.

AOTAutograd keeps FlexAttention as higher-order ops, `flex_attention` and (in training graphs)
`flex_attention_backward`, whose score_mod / mask_mod (and, backward, the score_mod's joint
graph) are graph modules passed as arguments; there is no single ATen op to lower. PyTorch's own
CPU path runs them as dense math (`sdpa_dense`, `sdpa_dense_backward`: scores for every query and
key, the mods applied with vmap over (b, h, q, kv), masked softmax). Here each such node is
replaced by that same dense implementation, traced with make_fx under the graph's fake mode and
tpuc's decomposition table, so the mods and the block mask become ordinary ops (index, where,
comparisons) that tpuc lowers, and the results are the ones eager computes.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._higher_order_ops.flex_attention import sdpa_dense, sdpa_dense_backward
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx


def _zeros_and_scatter(shape, indices, vals):
    """`flex_lib::zeros_and_scatter` (the backward of indexing a captured tensor inside a
    score_mod, in the joint graph): a custom op with no decomposition of its own. Its eager
    body."""
    if not indices:
        return vals.sum()
    grad = torch.zeros(shape, device=vals.device, dtype=vals.dtype)
    return torch.ops.aten.index_put(grad, indices, vals, accumulate=True)


_DENSE = {
    torch.ops.higher_order.flex_attention: sdpa_dense,
    torch.ops.higher_order.flex_attention_backward: sdpa_dense_backward,
}


def _table(decompositions: dict) -> dict:
    """tpuc's table, plus what only the dense implementation brings: `new_empty_strided` (its
    outputs take the query's strides) and `zeros_and_scatter` (backward)."""
    table = {**decompositions, **get_decompositions([torch.ops.aten.new_empty_strided])}
    try:
        table[torch.ops.flex_lib.zeros_and_scatter.default] = _zeros_and_scatter
    except (AttributeError, RuntimeError):
        pass
    return table


def inline_flex_attention(gm: torch.fx.GraphModule, decompositions: dict) -> int:
    """Replaces every flex_attention / flex_attention_backward node of `gm` by its dense
    implementation in ATen ops (see the module doc). Returns how many were replaced."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DENSE]
    if not nodes:
        return 0
    table = _table(decompositions)
    for n in nodes:
        _inline(gm, n, table)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return len(nodes)


def _inline(gm: torch.fx.GraphModule, n: torch.fx.Node, table: dict) -> None:
    leaves, spec = pytree.tree_flatten((n.args, n.kwargs))
    inputs = []  # the nodes whose values become inputs of the traced function, in order
    consts = list(leaves)
    for i, a in enumerate(leaves):
        if not isinstance(a, torch.fx.Node):
            continue
        if a.op == "get_attr":
            consts[i] = getattr(gm, a.target)  # score_mod / mask_mod / joint graph modules
        else:
            inputs.append((i, a))
    vals = [a.meta["val"] for _, a in inputs]
    dense = _DENSE[n.target]

    def fn(*xs):
        args = list(consts)
        for (i, _), x in zip(inputs, xs, strict=True):
            args[i] = x
        a, kw = pytree.tree_unflatten(args, spec)
        return dense(*a, **kw)

    fake_mode = torch._guards.detect_fake_mode(vals)
    with fake_mode:
        traced = make_fx(
            torch.func.functionalize(fn, remove="mutations"),
            decomposition_table=table,
        )(*vals)

    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = iter(a for _, a in inputs)
    out = None
    with gm.graph.inserting_before(n):
        for t in traced.graph.nodes:
            if t.op == "placeholder":
                env[t] = next(placeholders)
                continue
            if t.op == "output":
                out = t.args[0]
                continue
            env[t] = _copy_node(gm, traced, t, env)
            env[t].meta = {**t.meta, **{k: n.meta[k] for k in ("stack_trace", "from_node") if k in n.meta}}
    result = torch.fx.node.map_arg(out, lambda x: env[x])
    _replace_results(gm, n, result)
    gm.graph.erase_node(n)


def _copy_node(gm: torch.fx.GraphModule, traced: torch.fx.GraphModule, t: torch.fx.Node, env: dict):
    """`t`, a node of the traced dense implementation, added to `gm`."""
    graph = gm.graph
    if t.op == "get_attr":
        const = getattr(traced, t.target)  # a tensor the implementation made (the -inf fill)
        if const.dim() == 0:  # a scalar: no extra graph input for it
            with unset_fake_temporarily():  # AOTAutograd calls tpuc with its fake mode on
                value = const.item()
            return graph.call_function(
                torch.ops.aten.scalar_tensor.default,
                (value,),
                {"dtype": const.dtype, "device": t.meta["val"].device},
            )
        i = 0
        while hasattr(gm, f"_flex_constant{i}"):
            i += 1
        setattr(gm, f"_flex_constant{i}", const)
        return graph.create_node("get_attr", f"_flex_constant{i}")  # a plain tensor attribute
    if t.target is torch.ops.aten._to_copy.default and not isinstance(t.args[0], torch.fx.Node):
        # vmap's type promotion of a Python number in the mods (`score / 20`) casts it as a
        # wrapped-number tensor, which make_fx records as the bare number.
        val = t.meta["val"]
        return graph.call_function(
            torch.ops.aten.scalar_tensor.default, (t.args[0],), {"dtype": val.dtype, "device": val.device}
        )
    return graph.node_copy(t, lambda x: env[x])


def _replace_results(gm: torch.fx.GraphModule, n: torch.fx.Node, result) -> None:
    """Points the users of `n`, which take its (nested) results with getitem, at `result`, the
    same structure of new nodes."""
    for user in list(n.users):
        if user.op != "call_function" or user.target.__name__ != "getitem":
            raise RuntimeError(f"tpuc: unexpected use `{user.name}` of the result of `{n.name}`")
        part = result[user.args[1]]
        if isinstance(part, torch.fx.Node):
            user.replace_all_uses_with(part)
        elif part is None:
            for u in list(user.users):
                u.args, u.kwargs = torch.fx.node.map_arg(
                    (u.args, u.kwargs), lambda x, user=user: None if x is user else x
                )
        else:
            _replace_results(gm, user, part)
        gm.graph.erase_node(user)
