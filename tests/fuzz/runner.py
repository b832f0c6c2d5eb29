"""Runs fuzz programs eagerly and through tpuc, compares, shrinks mismatches, writes reproducers."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

import tpuc
from fuzz.gen import Program, _known_bug, evaluate, exact_outputs

OPTIONS = {"fallback": "error", "cache_dir": None}
RTOL = 2e-3
REGRESSIONS = Path(__file__).parent / "regressions"


@dataclass
class Outcome:
    kind: str  # "ok", "mismatch", "error" (a clear tpuc error), "internal" (any other exception)
    detail: str = ""
    error_type: str = ""
    step: int | None = None  # stateful programs (stateful.py, customops.py): the failing call

    @property
    def bad(self) -> bool:
        return self.kind in ("mismatch", "internal")


def compile_fn(fn):
    return torch.compile(fn, backend="tpu", dynamic=False, options=OPTIONS)


def _f64(t):
    return t.double() if t.dtype == torch.float32 else t


def compare(actual, expected, exact=None, reference=None) -> str | None:
    """None when `actual` matches `expected` (eager), else what differs.

    Shapes and dtypes must be equal; ints and bools exactly; NaN and inf at the same places. Floats:
    exact outputs (see gen.py) to 1e-6 relative, others to RTOL relative plus an absolute part
    scaled by the output's magnitude. `reference` (the program in float64) excuses a float
    difference where eager float32 is itself about as far from float64 as tpuc is: an unstable
    computation, not a compiler bug."""
    if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
        return f"output structure: {type(actual).__name__} of {len(actual)} vs {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not isinstance(a, torch.Tensor):
            return f"output {k}: {type(a).__name__}, expected a tensor"
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"output {k}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}"
        if not e.dtype.is_floating_point:
            if not torch.equal(a, e):
                bad = (a != e).nonzero()[:3].tolist()
                return f"output {k}: values differ at {bad}: {a[tuple(zip(*bad, strict=True))].tolist()} vs {e[tuple(zip(*bad, strict=True))].tolist()}"
            continue
        nan_a, nan_e = a.isnan(), e.isnan()
        if not torch.equal(nan_a, nan_e):
            return f"output {k}: NaN at different places ({int(nan_a.sum())} vs eager {int(nan_e.sum())})"
        inf_a, inf_e = a.isinf(), e.isinf()
        if not torch.equal(inf_a, inf_e) or not torch.equal(a[inf_a], e[inf_e]):
            return f"output {k}: inf at different places or signs"
        fa, fe = a[a.isfinite()].double(), e[e.isfinite()].double()
        if not fe.numel():
            continue
        if exact is not None and exact[k]:
            tol = 1e-6 * fe.abs() + 1e-6
        else:
            tol = RTOL * fe.abs() + RTOL * max(1.0, float(fe.abs().max()))
        err = (fa - fe).abs()
        bad = err > tol
        if bad.any() and reference is not None and reference[k].shape == e.shape:
            r = reference[k][e.isfinite()].double()
            eager_err = (fe - r).abs()
            bad &= (fa - r).abs() > 4 * eager_err + tol
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            return f"output {k}: {float(fa[i])!r} vs eager {float(fe[i])!r} (max abs error {float(err.max()):.3g})"
    return None


def _unwrap(e: BaseException) -> BaseException:
    inner = getattr(e, "inner_exception", None)
    return _unwrap(inner) if inner is not None else e


def _classify(e: BaseException, prefix: str = "") -> Outcome:
    """The Outcome of an exception from a compiled call: a clear tpuc error, or an internal one."""
    inner = _unwrap(e)
    name = type(inner).__name__
    msg = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
    if isinstance(inner, (tpuc.TpucError, ValueError, NotImplementedError)):
        return Outcome("error", prefix + msg, name)
    return Outcome("internal", f"{prefix}{name}: {msg}", name)


def run(program: Program) -> Outcome:
    """Compiles and runs `program` through tpuc and compares with eager."""
    fn = program.function()
    inputs = program.make_inputs()
    return run_fn(fn, inputs, exact_outputs(program))


def run_fn(fn, inputs, exact=None) -> Outcome:
    torch._dynamo.reset()
    try:
        expected = fn(*[x.clone() for x in inputs])
    except Exception as e:  # noqa: BLE001
        return Outcome("invalid", f"eager raised {type(e).__name__}: {e}")
    try:
        actual = compile_fn(fn)(*[x.clone() for x in inputs])
    except Exception as e:  # noqa: BLE001 - classify every failure
        inner = _unwrap(e)
        name = type(inner).__name__
        msg = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
        if isinstance(inner, (tpuc.TpucError, ValueError, NotImplementedError)):
            return Outcome("error", msg, name)
        return Outcome("internal", f"{name}: {msg}", name)
    finally:
        torch._dynamo.reset()
    reference = None
    diff = compare(actual, expected, exact)
    if diff is not None:
        try:
            reference = fn(*[_f64(x) for x in inputs])
        except Exception:  # noqa: BLE001
            reference = None
        if reference is not None:
            diff = compare(actual, expected, exact, reference)
    return Outcome("ok") if diff is None else Outcome("mismatch", diff)


# ---------------------------------------------------------------------------------------------
# Shrinking
# ---------------------------------------------------------------------------------------------


def _rebuild(program: Program, subst: dict[int, int], shapes=None, special=None) -> Program | None:
    """`program` with uses of value k replaced by subst[k], dead nodes and unused inputs removed."""
    n_in = len(program.inputs)
    nodes = program.nodes
    outputs = [subst.get(o, o) for o in program.outputs]
    live = set(outputs)
    for k in range(len(nodes) - 1, -1, -1):
        if n_in + k in live:
            live.update(subst.get(a, a) for a in nodes[k].args)
    new_index: dict[int, int] = {}
    inputs = []
    for i, (shape, dt) in enumerate(program.inputs):
        if i in live:
            new_index[i] = len(inputs)
            inputs.append(((shapes or {}).get(i, shape), dt))
    if not inputs:
        return None
    new_nodes = []
    for k, node in enumerate(nodes):
        v = n_in + k
        if v in live:
            args = [new_index[subst.get(a, a)] for a in node.args]
            new_index[v] = len(inputs) + len(new_nodes)
            new_nodes.append(type(node)(node.expr, args, node.bits))
    out = Program(
        inputs,
        new_nodes,
        [new_index[o] for o in outputs],
        program.seed,
        program.special if special is None else special,
    )
    return out


def _valid(program: Program) -> bool:
    try:
        vals = evaluate(program, program.make_inputs())
    except Exception:  # noqa: BLE001
        return False
    return all(isinstance(v, torch.Tensor) for v in vals)


def _same_failure(a: Outcome, b: Outcome) -> bool:
    if a.kind != b.kind:
        return False
    return a.kind == "mismatch" or a.error_type == b.error_type


def shrink(program: Program, outcome: Outcome, budget: int = 80, run_program=None) -> tuple[Program, Outcome]:
    """Greedily drops outputs and nodes and shrinks input shapes while the failure persists.
    `run_program`: how a candidate runs (default `run`)."""
    tries = 0
    run_program = run_program or run

    def attempt(candidate):
        nonlocal tries
        if candidate is None or tries >= budget or not _valid(candidate):
            return None
        tries += 1
        got = run_program(candidate)
        return got if _same_failure(got, outcome) else None

    progress = True
    while progress and tries < budget:
        progress = False
        if len(program.outputs) > 1:
            for o in program.outputs:
                cand = _rebuild(program, {})
                cand = _rebuild(
                    Program(program.inputs, program.nodes, [o], program.seed, program.special), {}
                )
                got = attempt(cand)
                if got:
                    program, outcome, progress = cand, got, True
                    break
        n_in = len(program.inputs)
        for k in range(len(program.nodes) - 1, -1, -1):
            v = n_in + k
            for a in dict.fromkeys(program.nodes[k].args):
                got = attempt(cand := _rebuild(program, {v: a}))
                if got:
                    program, outcome, progress = cand, got, True
                    break
            if progress:
                break
        if progress:
            continue
        if program.special:
            got = attempt(cand := _rebuild(program, {}, special=False))
            if got:
                program, outcome, progress = cand, got, True
                continue
        for i, (shape, _) in enumerate(program.inputs):
            for d, size in enumerate(shape):
                for smaller in dict.fromkeys([1, size // 2, size - 1]):
                    if 0 <= smaller < size:
                        new_shape = shape[:d] + (smaller,) + shape[d + 1 :]
                        got = attempt(cand := _rebuild(program, {}, shapes={i: new_shape}))
                        if got:
                            program, outcome, progress = cand, got, True
                            break
                if progress:
                    break
            if progress:
                break
    return program, outcome


# ---------------------------------------------------------------------------------------------
# Reproducers
# ---------------------------------------------------------------------------------------------


def _literal(t: torch.Tensor) -> str:
    dtype = {torch.float32: "torch.float32", torch.int64: "torch.int64", torch.bool: "torch.bool"}[t.dtype]
    if t.numel() == 0:
        return f"torch.empty({list(t.shape)}, dtype={dtype})"
    return f"torch.tensor({t.tolist()!r}, dtype={dtype})"


def reproducer(program: Program, outcome: Outcome, name: str, xfail: str | None = None) -> str:
    """A standalone pytest file that fails while the bug is there."""
    inputs = ", ".join(_literal(t) for t in program.make_inputs())
    exact = exact_outputs(program)
    mark = f"@pytest.mark.xfail(strict=True, reason={xfail!r})\n" if xfail else ""
    body = textwrap.indent(program.source("program"), "")
    detail = outcome.detail.replace("\n", " ")
    return f'''"""Fuzzer regression {name}: {outcome.kind}: {detail}"""

import pytest
import torch
from fuzz.runner import run_fn

nan, inf = float("nan"), float("inf")


{body}

def inputs():
    return [{inputs}]


{mark}def test_{name}():
    outcome = run_fn(program, inputs(), exact={exact!r})
    assert outcome.kind in ("ok", "error"), outcome.detail
'''


def save_regression(program: Program, outcome: Outcome, name: str, xfail: str | None = None) -> Path:
    REGRESSIONS.mkdir(exist_ok=True)
    path = REGRESSIONS / f"test_{re.sub(r'[^a-z0-9_]', '_', name.lower())}.py"
    path.write_text(reproducer(program, outcome, name, xfail))
    return path


# ---------------------------------------------------------------------------------------------
# Dynamic dims with a declared maximum (bucketing)
# ---------------------------------------------------------------------------------------------

DYNAMIC_MAX = 16


def dynamic_variant(program: Program, size: int) -> tuple[Program, list[int]] | None:
    """`program` with dim 0 of its full-rank inputs set to `size`, and which inputs those are."""
    rank = max(len(s) for s, _ in program.inputs)
    if rank == 0:
        return None
    marked = [i for i, (s, _) in enumerate(program.inputs) if len(s) == rank and s[0] >= 2]
    if not marked:
        return None
    d0 = program.inputs[marked[0]][0][0]
    marked = [i for i in marked if program.inputs[i][0][0] == d0]
    shapes = {i: (size, *program.inputs[i][0][1:]) for i in marked}
    inputs = [(shapes.get(i, s), dt) for i, (s, dt) in enumerate(program.inputs)]
    return Program(inputs, program.nodes, program.outputs, program.seed, program.special), marked


def run_dynamic(program: Program, sizes: tuple[int, int], include_known: bool = False) -> Outcome:
    """Marks dim 0 of the full-rank inputs dynamic (max DYNAMIC_MAX) and runs one compiled function
    at two sizes of that dim: bucketed executables must give eager's results at both."""
    variants = [dynamic_variant(program, s) for s in sizes]
    if any(v is None or not _valid(v[0]) for v in variants):
        return Outcome("invalid", "no dynamic dim")
    for v, _ in variants:  # new sizes, new input values: may trigger a known bug
        vals = evaluate(v, v.make_inputs())
        n_in = len(v.inputs)
        for k, node in enumerate(v.nodes):
            bug = _known_bug(node.expr, [vals[a] for a in node.args])
            if bug and not include_known:
                return Outcome("invalid", f"known bug {bug} at node v{n_in + k}")
    torch._dynamo.reset()
    fn = program.function()
    compiled = compile_fn(fn)
    try:
        for v, marked in variants:
            inputs = v.make_inputs()
            expected = fn(*[x.clone() for x in inputs])
            args = [x.clone() for x in inputs]
            for i in marked:
                torch._dynamo.mark_dynamic(args[i], 0, min=2, max=DYNAMIC_MAX)
            try:
                actual = compiled(*args)
            except Exception as e:  # noqa: BLE001 - classify every failure
                inner = _unwrap(e)
                name = type(inner).__name__
                msg = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
                if "Constraint" in name or "UserError" in name or "specializ" in str(inner).lower():
                    return Outcome("invalid", f"Dynamo specialized the dim: {msg}")
                if isinstance(inner, (tpuc.TpucError, ValueError, NotImplementedError)):
                    return Outcome("error", msg, name)
                return Outcome("internal", f"{name}: {msg}", name)
            diff = compare(actual, expected, exact_outputs(v))
            if diff is not None:
                reference = fn(*[_f64(x) for x in inputs])
                diff = compare(actual, expected, exact_outputs(v), reference)
            if diff is not None:
                return Outcome("mismatch", f"dim 0 = {v.inputs[marked[0]][0][0]}: {diff}")
    finally:
        torch._dynamo.reset()
    return Outcome("ok")
