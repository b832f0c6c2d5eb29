"""AOTAutograd's compiler hook (`compile_graph`): one forward or backward graph to a boxed
callable. Writes into inputs, outputs that are views of inputs, runtime checks and tie-order
checks are taken out of the graph and done around the call; compile regions, PyTorch's own
kernels and unsupported ops are partitioned off; the rest is one `CompiledGraph`."""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from . import (
    _native,
    counters,
    flex,
    input_views,
    mutations,
    regions,
    runtime,
    ties,
    torch_kernels,
)
from .decompositions import _decompositions
from .op_support import _unsupported_nodes, _why_unsupported
from .partitions import _compile_or_fallback, _origin, _partitioned, _warn_fallback
from .storage_ops import _rebase_storage_ops


def _hoist_checks(gm: torch.fx.GraphModule) -> list[tuple]:
    """Takes the graph's runtime checks out of `gm`, to run on the host after each call, so
    errors are raised exactly as PyTorch raises them:
    - the effectful `_linalg_check_errors` calls (`with_effects` nodes: linalg.inv, solve,
      cholesky ... raising on singular or non-positive-definite input): each one's `info`
      tensor becomes an extra graph output and its token passes through unchanged;
    - `_assert_async` (`torch._assert_async(cond, msg)`, which diffusers' models call on
      data-dependent conditions; XLA has no way to raise): its condition becomes an extra
      graph output.
    Returns one (check function, args after the tensor, kwargs) per extra output, in output
    order, for `_Checked`."""
    check = torch.ops.aten._linalg_check_errors.default
    asserts = (torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg)
    checks, tensors = [], []
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in asserts and not n.users:
            checks.append((torch._assert_async, tuple(n.args[1:]), dict(n.kwargs)))
            tensors.append(n.args[0])
            gm.graph.erase_node(n)
            continue
        if not (n.target is torch.ops.higher_order.with_effects and len(n.args) >= 3 and n.args[1] is check):
            continue
        token, info, rest = n.args[0], n.args[2], n.args[3:]
        for user in list(n.users):
            if user.op == "call_function" and user.target.__name__ == "getitem" and user.args[1] == 0:
                user.replace_all_uses_with(token)
                gm.graph.erase_node(user)
        if n.users:
            raise _native.TpucError(f"unexpected use of the result of `{n.name}` ({check})")
        gm.graph.erase_node(n)
        checks.append((torch._linalg_check_errors, tuple(rest), dict(n.kwargs)))
        tensors.append(info)
    if not checks:
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0]
    out.args = ((*outs, *tensors),) if isinstance(outs, list | tuple) else ((outs, *tensors),)
    gm.graph.lint()
    gm.recompile()
    return checks


class _Checked:
    """Runs a compiled graph whose checks (`_linalg_check_errors`, `_assert_async`) were
    hoisted out, then the checks on the returned tensors (raising PyTorch's own errors)."""

    _boxed_call = True

    def __init__(self, inner, checks: list[tuple]):
        self.inner, self.checks = inner, checks

    def __call__(self, args):
        # Effect tokens arrive as None (AOTAutograd's runtime wrapper drops the real ones); the
        # graph only passes them through.
        if any(a is None for a in args):
            token = torch.empty(0)
            args = [token if a is None else a for a in args]
        outs = list(self.inner(args))
        k = len(self.checks)
        for t, (fn, rest, kwargs) in zip(outs[len(outs) - k :], self.checks, strict=True):
            fn(t, *rest, **kwargs)
        return outs[: len(outs) - k]


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs,
    opts,
    name: str,
    traces: dict | None = None,
    maxima=None,
    shard=None,
    free_layouts=None,
):
    """AOTAutograd's compiler hook: a boxed callable that runs `gm` through tpuc. `traces` maps
    Dynamo node names to their stack traces, for error messages; `shard`: (sharding Context,
    "forward" | "backward") when a mesh is set; `free_layouts`: see CompiledGraph."""
    flex.inline_flex_attention(gm, _decompositions(bool(maxima)))
    # Writes into inputs AOTAutograd left in the graph become outputs, written back after the call.
    writes = mutations.split(gm, rows_allowed=not maxima and shard is None)
    # Outputs that are views of inputs are made from the inputs at call time (not on a mesh,
    # whose plan places every output); an output that is an input is the caller's tensor (IR).
    taken = input_views.split(gm) if shard is None else {}
    if taken and free_layouts is not None:
        positions, back = input_views.remap_positions(taken, free_layouts[0])
        report = free_layouts[1]
        free_layouts = (positions, lambda perms: report({back[p]: perm for p, perm in perms.items()}))
    checks = _hoist_checks(gm)
    _rebase_storage_ops(gm)
    n_ties = 0
    tie_nodes = ties.checked_nodes(gm)
    if tie_nodes:
        as_is = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # what PyTorch runs, for ties
        n_ties = ties.add_tie_checks(gm, tie_nodes)
    inner = _compile_hook(gm, opts, name, traces, maxima, shard, free_layouts)
    if n_ties:
        inner = ties.TieChecked(inner, n_ties, as_is.forward, name)
    inner = _Checked(inner, checks) if checks else inner
    inner = input_views.WithInputViews(inner, taken) if taken else inner
    return mutations.WithWrites(inner, writes) if writes is not None else inner


def _compile_hook(
    gm: torch.fx.GraphModule, opts, name: str, traces: dict | None, maxima, shard, free_layouts=None
):
    traces = traces or {}
    part_shard = (shard[0], "partition") if shard is not None else None
    if regions.inlined(opts, runtime.plugin_family(runtime.resolve_plugin(opts.plugin), opts.plugin)):
        regions.inline_regions(gm)
    in_regions = regions.compile_regions(
        gm,
        lambda sub, ins, sub_name: compile_graph(
            sub, ins, opts, f"{name}.{sub_name}", traces, maxima, part_shard
        ),
    )
    bad = [n for n in _unsupported_nodes(gm) if n not in in_regions]
    in_torch = _torch_kernel_nodes(gm, opts, shard)
    if not bad and not in_torch and not in_regions:
        compiled = _compile_or_fallback(gm, opts, name, maxima, shard, free_layouts)
        return compiled if compiled is not None else make_boxed_func(gm.forward)
    for n in in_torch:
        counters.count_torch_kernel(str(n.target))
    in_torch = [*in_torch, *in_regions]
    if not bad:
        return make_boxed_func(_partitioned(gm, opts, name, maxima, shard, set(in_torch)).forward)
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
    fused = _partitioned(gm, opts, name, maxima, shard, set(in_torch))
    return make_boxed_func(fused.forward)


def _torch_kernel_nodes(gm: torch.fx.GraphModule, opts, shard) -> list[torch.fx.Node]:
    """The nodes to run through PyTorch's own kernel (see torch_kernels.py): only on the CPU
    plugin and unsharded (a partitioned graph would leave the mesh)."""
    candidates = torch_kernels.nodes(gm) if shard is None else []
    if not candidates or not runtime.get_runtime(opts.plugin, None, opts.plugin_options).host_zero_copy:
        return []
    return candidates
