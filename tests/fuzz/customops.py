"""Custom ops (`torch.library.custom_op`, namespace `tpucfuzz::`) placed at random positions in
gen.py's programs. tpuc has no lowering for them, so with `fallback="eager"` the graph is
partitioned around them (python/tpuc/partitions.py `_partitioned`) and the fallback boundaries fall
wherever the generator put the op.

The ops: pure ones (numpy, torch), host-reading ones (`.tolist()` / `.item()` on an argument decide
a roll amount or a repeat count; the output shape is fixed, from the fake), one that returns a new
tensor made from a view, and in-place ones (`mutates_args=("out",)`) that mutate an earlier value
of the program (an input, or a view of one: the compiled function must write the mutation back).
Every op keeps gen.py's exactness bookkeeping: exact values stay exact, and the host-reading ops
only read exact values, so both sides decide the same shapes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fuzz.gen import Program, _exact, _grow, _pick, exact_outputs, generate
from fuzz.runner import Outcome

NAMESPACE = "tpucfuzz"
_OPS: dict[str, object] = {}


def _host_sum(t: torch.Tensor) -> int:
    """An integer from `t`'s values, read on the host (`.tolist()`): the sum of the finite ones."""
    return int(sum(float(v) for v in t.flatten().tolist() if math.isfinite(float(v))))


def register() -> None:
    """Registers the ops once per process (a second import of this module finds them)."""
    if _OPS:
        return
    try:
        existing = torch.ops.tpucfuzz.np_affine
    except (AttributeError, RuntimeError):
        existing = None
    if existing is not None:  # registered by another copy of this module (another import path)
        _OPS["np_affine"] = existing
        return

    @torch.library.custom_op(f"{NAMESPACE}::np_affine", mutates_args=())
    def np_affine(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.int64):
            raise TypeError(f"np_affine: {x.dtype}")
        a = x.detach().numpy()
        return torch.from_numpy(np.array(a * 2 + 1, dtype=a.dtype).reshape(a.shape))  # 0-d stays 0-d

    @np_affine.register_fake
    def _(x):
        return x.new_empty(x.shape)

    @torch.library.custom_op(f"{NAMESPACE}::t_affine", mutates_args=())
    def t_affine(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"t_affine: {x.dtype}")
        return (x * a + b).contiguous()

    @t_affine.register_fake
    def _(x, a, b):
        return x.new_empty(x.shape)

    @torch.library.custom_op(f"{NAMESPACE}::host_roll", mutates_args=())
    def host_roll(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        # The slice bounds come from k's values on the host.
        flat = x.flatten()
        s = _host_sum(k) % max(flat.numel(), 1)
        return torch.cat([flat[s:], flat[:s]]).reshape(x.shape)

    @host_roll.register_fake
    def _(x, k):
        return x.new_empty(x.shape)

    @torch.library.custom_op(f"{NAMESPACE}::host_repeat", mutates_args=())
    def host_repeat(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        # A repeat count from r's values (`.item()`), then a slice back to x's shape.
        reps = 1 + int((r > 0).sum().item()) % 3
        if x.dim() == 0:
            return x.clone()
        return x.repeat_interleave(reps, dim=-1)[..., : x.shape[-1]].contiguous()

    @host_repeat.register_fake
    def _(x, r):
        return x.new_empty(x.shape)

    @torch.library.custom_op(f"{NAMESPACE}::host_count", mutates_args=())
    def host_count(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(sum(1 for v in x.flatten().tolist() if v > 0), dtype=torch.int64)

    @host_count.register_fake
    def _(x):
        return x.new_empty((), dtype=torch.int64)

    @torch.library.custom_op(f"{NAMESPACE}::every_other", mutates_args=())
    def every_other(x: torch.Tensor) -> torch.Tensor:
        # A new tensor made from a (strided) view of the argument.
        return x.flatten()[::2].clone()

    @every_other.register_fake
    def _(x):
        return x.new_empty(((x.numel() + 1) // 2,))

    @torch.library.custom_op(f"{NAMESPACE}::swap_last", mutates_args=())
    def swap_last(x: torch.Tensor) -> torch.Tensor:
        # (.contiguous() would return a zero-size x's view itself: an output may not alias an input)
        return x.transpose(-1, -2).clone(memory_format=torch.contiguous_format) if x.dim() >= 2 else x.clone()

    @swap_last.register_fake
    def _(x):
        if x.dim() < 2:
            return x.new_empty(x.shape)
        return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))

    @torch.library.custom_op(f"{NAMESPACE}::neg_", mutates_args=("out",))
    def neg_(out: torch.Tensor) -> None:
        out.neg_()

    @neg_.register_fake
    def _(out):
        return None

    @torch.library.custom_op(f"{NAMESPACE}::clamp_", mutates_args=("out",))
    def clamp_(out: torch.Tensor, lo: float, hi: float) -> None:
        out.clamp_(lo, hi)

    @clamp_.register_fake
    def _(out, lo, hi):
        return None

    @torch.library.custom_op(f"{NAMESPACE}::add_into", mutates_args=("out",))
    def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
        out.add_(x)

    @add_into.register_fake
    def _(out, x):
        return None

    _OPS.update(
        np_affine=np_affine,
        t_affine=t_affine,
        host_roll=host_roll,
        host_repeat=host_repeat,
        host_count=host_count,
        every_other=every_other,
        swap_last=swap_last,
        neg_=neg_,
        clamp_=clamp_,
        add_into=add_into,
    )


def _pick_recent(rng, vals, bits, pred):
    """Like gen._pick, but half the time the latest value that fits: the op then sits inside the
    chain of computed values, with supported ops on both sides (a partition before and after)."""
    if rng.random() < 0.5:
        for i in range(len(vals) - 1, -1, -1):
            if pred(vals[i], bits[i]):
                return i
    return _pick(rng, vals, bits, pred)


P = "torch.ops.tpucfuzz."  # in-place ops return None: `(op(v, ...), v)[1]` names the mutated value


def op_custom(rng, vals, bits):
    """A node calling one of the custom ops (a maker for gen.generate's catalog)."""
    r = rng.random()
    if r < 0.15:
        i = _pick_recent(rng, vals, bits, lambda t, b: t.dtype != torch.bool)
        if i is None:
            return None
        nb = _grow(bits[i], 2) if vals[i].dtype == torch.float32 else 0
        return P + "np_affine({0})", [i], nb
    if r < 0.25:
        i = _pick_recent(rng, vals, bits, lambda t, b: t.dtype == torch.float32)
        if i is None:
            return None
        a, b = rng.choice([0.5, -1.0, 2.0, 0.25]), rng.choice([0.0, 1.0, -0.75])
        return P + f"t_affine({{0}}, {a}, {b})", [i], _grow(bits[i], 3)
    if r < 0.5:
        # Host-reading: the host only reads exact values (same decision on both sides).
        i = _pick_recent(rng, vals, bits, lambda t, b: True)
        j = _pick(rng, vals, bits, lambda t, b: _exact(t, b) and t.numel() <= 64)
        if i is None or j is None:
            return None
        name = rng.choice(["host_roll", "host_repeat"])
        return P + f"{name}({{0}}, {{1}})", [i, j], bits[i]
    if r < 0.55:
        i = _pick_recent(rng, vals, bits, lambda t, b: _exact(t, b) and t.dtype != torch.bool)
        if i is None:
            return None
        return P + "host_count({0})", [i], 0
    if r < 0.7:
        i = _pick_recent(rng, vals, bits, lambda t, b: True)
        return P + rng.choice(["every_other({0})", "swap_last({0})"]), [i], bits[i]
    # In place, on any earlier value (program inputs included). Exactness is kept (bits of the
    # value and of its views do not grow), so values computed from it later stay comparable.
    i = _pick_recent(rng, vals, bits, lambda t, b: t.dtype != torch.bool)
    if i is None:
        return None
    if r < 0.8:
        return f"({P}neg_({{0}}), {{0}})[1]", [i], bits[i]
    if r < 0.9 or vals[i].dtype != torch.float32:
        lo, hi = rng.choice([(-2.0, 2.0), (-1.0, 3.5), (0.0, 1.0)])
        if vals[i].dtype != torch.float32:
            lo, hi = int(lo), int(hi)
        return f"({P}clamp_({{0}}, {lo}, {hi}), {{0}})[1]", [i], bits[i]
    # add_into(out, x): out's bits grow; only when `out` is exact and stays so with room to spare.
    j = _pick(rng, vals, bits, lambda t, b: t.dtype == torch.float32 and b is not None and b <= 8)
    if j is None or bits[i] is None or bits[i] > 8:
        return None
    return f"({P}add_into({{0}}, {{1}}), {{0}})[1]", [i, j], _grow(max(bits[i], bits[j]), 1)


CUSTOM_OPS = [(op_custom, 8)]


def custom_ops_in(program: Program) -> list[str]:
    """The names of the custom ops that `program` calls, in order."""
    out = []
    for n in program.nodes:
        if P in n.expr:
            out.append(n.expr.split(P, 1)[1].split("(", 1)[0])
    return out


def generate_custom(seed: int, max_nodes: int = 8) -> Program:
    """A gen.py program with at least one custom op and one other op, deterministic per seed.
    Every custom op's result is an output too, so that none is dead code (Dynamo would drop
    it, and its partition boundary with it)."""
    register()
    program = None
    for salt in range(1, 17):
        program = generate(seed, max_nodes=max_nodes, extra_ops=CUSTOM_OPS, salt=salt)
        ops = custom_ops_in(program)
        if ops and len(ops) < len(program.nodes):
            break
    n_in = len(program.inputs)
    custom = [n_in + k for k, node in enumerate(program.nodes) if P in node.expr]
    program.outputs = sorted(set(program.outputs) | set(custom))
    return program


CUSTOM_OPTIONS = {"fallback": "eager", "cache_dir": None}


def _compile(fn, backend: str):
    if backend == "tpu":
        return torch.compile(fn, backend="tpu", dynamic=False, options=CUSTOM_OPTIONS)
    return torch.compile(fn, backend=backend, dynamic=False)


# What happens to the arguments before each call of run_custom (as stateful.py's input policies).
CALL_POLICIES = ["fresh", "reuse", "reuse_data_copy", "reuse_data_assign"]


def _negate(a: torch.Tensor) -> torch.Tensor:
    return a.logical_not() if a.dtype == torch.bool else a.neg()


def run_custom(program: Program, calls: int = len(CALL_POLICIES), backend: str = "tpu") -> Outcome:
    """Runs `program` compiled (fallback="eager": partitions around the custom ops) `calls` times
    and compares, after every call, the outputs and the inputs (in-place custom ops may mutate
    them) with eager run on clones of the same arguments. Later calls reuse the first call's
    argument objects (as the program left them), negated without a version bump before the third
    call (`a.data.copy_(-a)`) and given new memory before the fourth (`a.data = -a`); negated
    exact values stay exact."""
    import warnings

    from fuzz.runner import _classify, compare

    register()
    fn = program.function()
    exact = exact_outputs(program)
    args = program.make_inputs()
    torch._dynamo.reset()
    compiled = _compile(fn, backend)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for call in range(calls):
                policy = CALL_POLICIES[min(call, len(CALL_POLICIES) - 1)]
                for a in args:
                    if policy == "reuse_data_copy":
                        a.data.copy_(_negate(a.data))
                    elif policy == "reuse_data_assign":
                        a.data = _negate(a.data)
                eager_args = [a.clone() for a in args]
                try:
                    expected = fn(*eager_args)
                except Exception as e:  # noqa: BLE001
                    return Outcome("invalid", f"eager raised {type(e).__name__}: {e}")
                try:
                    actual = compiled(*args)
                except Exception as e:  # noqa: BLE001 - classify every failure
                    got = _classify(e, f"call {call}: ")
                    got.step = call
                    return got
                diff = compare(actual, expected, exact)
                if diff is None:
                    diff = compare(args, eager_args, [True] * len(args))
                    diff = diff and "input " + diff
                if diff is not None:
                    return Outcome("mismatch", f"call {call}: {diff}", step=call)
    finally:
        torch._dynamo.reset()
    return Outcome("ok")
