"""Consecutive calls of one `@nested_compile_region` block as one loop (option `regions="loop"`).

A decoder's layers, marked, reach tpuc as a chain of `invoke_subgraph` calls of one subgraph,
each call's block output feeding the next call (AOTAutograd's backward graph has the same chain
of the backward subgraph, in reverse layer order). `loop_chains` replaces such a chain of k >= 2
calls by one `torch.ops.higher_order.scan` over the block's operands stacked along a new leading
dim, so the program holds the block once (one `stablehlo.while`, docs/control-flow.md) and its
compile time does not grow with depth:

* carries: the operands that the previous call's outputs feed (the activation; the incoming
  gradient in a backward graph), initialised from the first call's;
* scanned inputs (`xs`): operands that differ between calls (each layer's parameters, a backward
  call's saved tensors), stacked: where they are all inputs of the graph, by `StackedInputs`
  around the compiled callable (a stack of parameters made once and kept until one of them is
  written, as resident parameters are), else in the graph (`cat` of `unsqueeze`s);
* additional inputs: operands every call shares (a mask);
* per-step outputs (`ys`): every output used outside the chain (a forward graph's saved tensors,
  a backward graph's weight gradients), stacked by the loop and taken apart with `aten.select`
  for their users, so each layer's gradient is its own output as before.

A chain is rewritten only when that is exact: a block that draws no random numbers (each
layer's dropout must draw its own mask; tpuc passes no seed into loop bodies yet), operands that are tensors with equal shapes and
dtypes across the calls, nothing that a call's operands read computed from an earlier call of
the chain but the carries, and every use of a call's outputs after the chain's last call.
Anything else keeps its calls (compiled per `regions`' other modes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import NamedTuple

import torch
import torch.fx

from . import counters, residency
from .regions import call_sites

#: Fewest consecutive calls worth a loop: one call is the block itself.
MIN_CHAIN = 2


@dataclasses.dataclass
class _Chain:
    calls: list[torch.fx.Node]
    sub: torch.fx.GraphModule
    #: (operand position, output index): the operand each call after the first takes from the
    #: previous call's output.
    carries: list[tuple[int, int]]


def _sub(gm: torch.fx.GraphModule, call: torch.fx.Node):
    attr = call.args[0]
    return getattr(gm, attr.target) if isinstance(attr, torch.fx.Node) else attr


def _operands(call: torch.fx.Node) -> tuple:
    return tuple(call.args[2:])


def _fed(prev: torch.fx.Node, call: torch.fx.Node) -> list[tuple[int, int]]:
    """(position, output index) of each operand of `call` that is an output of `prev`."""
    out = []
    for pos, a in enumerate(_operands(call)):
        if (
            isinstance(a, torch.fx.Node)
            and a.op == "call_function"
            and a.target is operator.getitem
            and a.args[0] is prev
        ):
            out.append((pos, a.args[1]))
    return out


def _chains(gm: torch.fx.GraphModule) -> list[_Chain]:
    """Maximal runs of calls of one subgraph, each fed by the previous one at the same operand
    positions from the same outputs."""
    chains: list[_Chain] = []
    cur: _Chain | None = None
    for call in call_sites(gm):
        sub = _sub(gm, call)
        if cur is not None and sub is cur.sub:
            fed = _fed(cur.calls[-1], call)
            if fed and (len(cur.calls) == 1 or fed == cur.carries):
                cur.carries = fed
                cur.calls.append(call)
                continue
        if cur is not None and len(cur.calls) >= MIN_CHAIN:
            chains.append(cur)
        cur = _Chain([call], sub, [])
    if cur is not None and len(cur.calls) >= MIN_CHAIN:
        chains.append(cur)
    return chains


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else None


def _descendants(start: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _draws_random(sub: torch.fx.GraphModule) -> bool:
    """Whether `sub` (or a graph it calls) draws random numbers: each layer must draw its own,
    and tpuc does not pass its seed into loop bodies yet."""
    for n in sub.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in n.target.tags and _dropout_p(n) != 0:
                return True
        if n.op == "get_attr" and isinstance(getattr(sub, n.target, None), torch.fx.GraphModule):
            if _draws_random(getattr(sub, n.target)):
                return True
    return False


def _dropout_p(n: torch.fx.Node):
    """The `dropout_p` argument of a seeded op that has one (attention: 0 draws nothing), else
    None (the op draws)."""
    for i, a in enumerate(n.target._schema.arguments):
        if a.name == "dropout_p":
            return n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
    return None


def _why_not(gm: torch.fx.GraphModule, ch: _Chain) -> str | None:
    """Why the chain cannot be a loop (None: it can)."""
    if _draws_random(ch.sub):
        return "the block draws random numbers (dropout)"
    ops = [_operands(c) for c in ch.calls]
    carried = {p for p, _ in ch.carries}
    after_first = _descendants(ch.calls[0])
    for pos in range(len(ops[0])):
        column = [o[pos] for o in ops]
        vals = [_val(a) for a in column]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            if pos not in carried and all(a is column[0] for a in column):
                continue  # a size every call passes (a bucketed dim): a shared input
            return f"operand {pos} is not a tensor at every call"
        if any(v.shape != vals[0].shape or v.dtype != vals[0].dtype for v in vals):
            return f"operand {pos} differs in shape or dtype between the calls"
        if pos not in carried and any(a in after_first for a in column):
            return f"operand {pos} is computed from an earlier call of the chain"
    out_node = next(n for n in ch.sub.graph.nodes if n.op == "output")
    results = out_node.args[0]
    results = results if isinstance(results, list | tuple) else (results,)
    if not all(isinstance(r, torch.fx.Node) and isinstance(_val(r), torch.Tensor) for r in results):
        return "the block returns something other than tensors"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = order[ch.calls[-1]]
    for c in ch.calls:
        for g in c.users:
            if g.op != "call_function" or g.target is not operator.getitem:
                return f"a use of `{c.name}` other than taking its outputs apart"
            for u in g.users:
                if u not in ch.calls and order[u] < last:
                    return f"`{u.name}` uses an output of `{c.name}` before the chain's last call"
    return None


def _fake_mode(vals):
    """The fake mode the graph's values live in (none: plain meta tensors)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(vals) or contextlib.nullcontext()


def _stack(gm: torch.fx.GraphModule, items: list[torch.fx.Node], fake) -> torch.fx.Node:
    """`items` stacked along a new leading dim, in the core ops tpuc lowers (`aten.stack` is
    decomposed before tpuc sees a graph): `cat` of each one `unsqueeze`d."""
    rows = []
    for a in items:
        r = gm.graph.call_function(torch.ops.aten.unsqueeze.default, (a, 0))
        with fake:
            r.meta["val"] = _val(a).unsqueeze(0)
        rows.append(r)
    s = gm.graph.call_function(torch.ops.aten.cat.default, (rows, 0))
    with fake:
        s.meta["val"] = torch.cat([_val(r) for r in rows])
    return s


def _stacked_input(gm: torch.fx.GraphModule, items: list[torch.fx.Node], fake, name: str) -> torch.fx.Node:
    """A new input of `gm` for `items` (inputs of `gm`) stacked: `StackedInputs` makes it."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        s = gm.graph.placeholder(name)
    with fake:
        s.meta["val"] = torch.stack([_val(a) for a in items])
    return s


def _loop(gm: torch.fx.GraphModule, ch: _Chain, index: int, stacks: list) -> None:
    calls, sub = ch.calls, ch.sub
    k = len(calls)
    ops = [_operands(c) for c in calls]
    n_ops = len(ops[0])
    carry_pos = [p for p, _ in ch.carries]
    carry_out = [j for _, j in ch.carries]
    shared = [p for p in range(n_ops) if p not in carry_pos and all(o[p] is ops[0][p] for o in ops)]
    scanned = [p for p in range(n_ops) if p not in carry_pos and p not in shared]

    # The outputs each call's users take (besides the next call's carries).
    def outside_uses(i: int) -> dict[int, torch.fx.Node]:
        taken = {}
        for g in calls[i].users:
            users = [u for u in g.users if not (i + 1 < k and u is calls[i + 1])]
            if users:
                taken[g.args[1]] = g
        return taken

    uses = [outside_uses(i) for i in range(k)]
    stepped = sorted({j for i in range(k) for j in uses[i] if not (i == k - 1 and j in carry_out)})

    # The loop's body: the block with its inputs in scan's order (carries, the step's slices of
    # the scanned inputs, the shared ones) and its outputs (next carries, per-step outputs).
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    body = torch.fx.Graph()
    env: dict = {}
    for p in (*carry_pos, *scanned, *shared):
        ph = body.placeholder(placeholders[p].name)
        ph.meta = dict(placeholders[p].meta)
        env[placeholders[p]] = ph
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    for n in sub.graph.nodes:
        if n.op not in ("placeholder", "output"):
            env[n] = body.node_copy(n, lambda a: env[a])
    results = out_node.args[0]
    results = results if isinstance(results, list | tuple) else (results,)
    body.output(tuple(env[results[j]] for j in (*carry_out, *stepped)))
    body_gm = torch.fx.GraphModule(sub, body)
    name = f"_block_loop_{index}"
    setattr(gm, name, body_gm)

    last = calls[-1]
    vals = [_val(a) for o in ops for a in o]
    fake = _fake_mode(vals)
    with gm.graph.inserting_before(last):
        xs = []
        for p in scanned:
            column = [o[p] for o in ops]
            if all(a.op == "placeholder" for a in column):  # made outside, kept (StackedInputs)
                xs.append(_stacked_input(gm, column, fake, f"_block_loop_{index}_stacked_{p}"))
                stacks.append((xs[-1], column))
            else:
                xs.append(_stack(gm, column, fake))
        attr = gm.graph.get_attr(name)
        init = tuple(ops[0][p] for p in carry_pos)
        loop = gm.graph.call_function(
            torch.ops.higher_order.scan, (attr, init, tuple(xs), tuple(ops[0][p] for p in shared))
        )
        out_vals = [_val(calls[-1])[j] for j in carry_out]
        with fake:
            out_vals += [torch.stack([_val(calls[0])[j]] * k) for j in stepped]
        loop.meta["val"] = tuple(out_vals)
        got = []
        for i, v in enumerate(out_vals):
            g = gm.graph.call_function(operator.getitem, (loop, i))
            g.meta["val"] = v
            got.append(g)
        carries_out = dict(zip(carry_out, got[: len(carry_out)], strict=True))
        ys = dict(zip(stepped, got[len(carry_out) :], strict=True))
        for i in range(k):
            for j, g in uses[i].items():
                if i == k - 1 and j in carries_out:
                    new = carries_out[j]
                else:
                    new = gm.graph.call_function(torch.ops.aten.select.int, (ys[j], 0, i))
                    new.meta["val"] = g.meta["val"]
                for u in list(g.users):
                    if not (i + 1 < k and u is calls[i + 1]):
                        u.replace_input_with(g, new)
    # Erase from the last call back: each call's getitems feed only the next (erased) call.
    for c in reversed(calls):
        for g in list(c.users):
            gm.graph.erase_node(g)
        attr_node = c.args[0]
        gm.graph.erase_node(c)
        if isinstance(attr_node, torch.fx.Node) and not attr_node.users:
            gm.graph.erase_node(attr_node)


def loop_chains(gm: torch.fx.GraphModule):
    """Replaces each chain of consecutive calls of one region (see the module's docstring) by
    one scan. Returns (how many chains became loops, a wrapper `inner -> StackedInputs` of the
    compiled callable, or None when the graph's inputs are unchanged)."""
    done = 0
    before = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stacks: list = []
    for index, ch in enumerate(_chains(gm)):
        if _why_not(gm, ch) is None:
            _loop(gm, ch, index, stacks)
            done += 1
    if not done:
        return 0, None
    for n in before:  # a parameter read only by the loop is passed stacked only
        if not n.users and any(n in column for _, column in stacks):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    counters.add(regions_looped=done)
    if not stacks:
        return done, None
    position = {n: i for i, n in enumerate(before)}
    after = [n for n in gm.graph.nodes if n.op == "placeholder"]
    made = {s: [position[a] for a in column] for s, column in stacks}
    plan = [("arg", position[n]) if n in position else ("stack", made[n]) for n in after]
    return done, lambda inner: StackedInputs(inner, plan)


class StackedInputs:
    """A boxed compiled graph whose loops read stacked inputs (`plan`: per input of the
    rewritten graph, ("arg", i): the caller's argument i, or ("stack", [i, ...]): those
    arguments stacked along a new leading dim). A stack of parameters is made once and kept
    while every member still stands for its copy in the stack by residency.py's rule for
    resident copies (the same tensor at the same address, with the same version and storage:
    an in-place write, an optimizer step, `load_state_dict` bump the version; `.data =` moves
    it); a stack of anything else is made at each call."""

    _boxed_call = True

    def __init__(self, inner, plan: list):
        self.inner = inner
        self.plan = plan
        self.kept: dict[int, tuple] = {}  # plan position -> ([_Member per member], stacked)

    def _stacked(self, slot: int, members: list):
        kept = self.kept.get(slot)
        if (
            kept is not None
            and len(kept[0]) == len(members)
            and all(
                residency.still_resident(k, m, m.data_ptr(), m.untyped_storage())
                for k, m in zip(kept[0], members, strict=True)
            )
        ):
            return kept[1]
        with torch.no_grad():
            s = torch.stack(members)
        stamp = _stamp(members)
        if stamp is not None and all(isinstance(m, torch.nn.Parameter) for m in members):
            self.kept[slot] = (stamp, s)
            counters.add(block_stacks_made=1)
        else:
            self.kept.pop(slot, None)
        return s

    def __call__(self, args):
        new = [
            args[what] if kind == "arg" else self._stacked(slot, [args[i] for i in what])
            for slot, (kind, what) in enumerate(self.plan)
        ]
        args.clear()  # boxed: the callee owns its arguments
        return self.inner(new)


class _Member(NamedTuple):
    """A stacked tensor as residency.still_resident reads a resident copy's slot."""

    tensor: torch.Tensor
    ptr: int
    version: int
    storage: object
    aliased: bool = False  # the stack is a copy, never the member's memory


def _stamp(members: list) -> list[_Member] | None:
    """A `_Member` per member, or None where one has no address or version (a fake or meta
    tensor, an inference tensor)."""
    try:
        if any(m.is_meta or isinstance(m, torch._subclasses.FakeTensor) for m in members):
            return None
        return [_Member(m, m.data_ptr(), m._version, m.untyped_storage()) for m in members]
    except RuntimeError:
        return None
