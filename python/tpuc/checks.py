"""Runtime checks taken out of a graph (`hoist`) and run on the host after each call
(`Checked`), so that errors are raised exactly as PyTorch raises them: XLA has no way to raise."""

from __future__ import annotations

import torch
import torch.fx

from . import _native


def hoist(gm: torch.fx.GraphModule) -> list[tuple]:
    """Takes the graph's runtime checks out of `gm`, to run on the host after each call, so
    errors are raised exactly as PyTorch raises them:
    - the effectful `_linalg_check_errors` calls (`with_effects` nodes: linalg.inv, solve,
      cholesky ... raising on singular or non-positive-definite input): each one's `info`
      tensor becomes an extra graph output and its token passes through unchanged;
    - `_assert_async` (`torch._assert_async(cond, msg)`, which diffusers' models call on
      data-dependent conditions; XLA has no way to raise): its condition becomes an extra
      graph output.
    Returns one (check function, args after the tensor, kwargs) per extra output, in output
    order, for `Checked`."""
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


class Checked:
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
