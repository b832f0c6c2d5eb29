"""The known-answer check of a CPU plugin's math: every elementwise and transcendental lowering
run on the plugin against PyTorch, at sizes that reach its vector code and at edge values, once
per plugin build and CPU (the result is kept beside the executable cache, keyed like it).

Why: a plugin's code for a primitive can be wrong on one CPU while tpuc's StableHLO is right
(lammps-jax-pjrt-cpu 0.11.2 returned garbage for `atan2(x, 1)` from 64 elements on). An op found
wrong is lowered with tpuc's own expansions of its primitives (compiler/src/lower/emit/own_math.rs)
from then on, with one warning naming the op, the plugin and the CPU.

The suite is one compiled program per dtype (all ops at all sizes), so the first use of a plugin
pays about a second; later processes read the kept result."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _native

# Bump when the suite changes: kept results of an older suite are not reused.
SUITE_VERSION = 1
# The full suite's sizes (`bench/plugin_conformance.py`); the check at run time keeps the two that
# reach a short vector tail and the vector loop with its remainder, each program compile costing
# about 50 ms per op and size.
SIZES = (1, 17, 64, 1000, 4099)
RUN_SIZES = (17, 4099)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# bfloat16's transcendental ops are float32's primitives between converts: the check at run time
# leaves them to the full suite.
RUN_DTYPES = (torch.float32, torch.float64)
# Wide enough that an op computed a few units in the last place off (ordinary libm differences)
# passes; the check is for wrong answers, not last-bit rounding.
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}
# Edge values spliced into every sweep of 17 elements or more (no subnormals: XLA's CPU code
# flushes them to zero, a documented difference for every op).
EDGES = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e30, -1e30, 1e-30, -1e-30, 1e300, -1e300, 1e-300)


# (ATen op, function, sweep range). Binary ops take the sweep and its reverse over `other`.
UNARY = (
    ("aten.exp.default", torch.exp, (-80.0, 80.0)),
    ("aten.expm1.default", torch.expm1, (-5.0, 5.0)),
    ("aten.exp2.default", torch.exp2, (-100.0, 100.0)),
    ("aten.log.default", torch.log, (1e-3, 1e3)),
    ("aten.log1p.default", torch.log1p, (-0.99, 10.0)),
    ("aten.log2.default", torch.log2, (1e-3, 1e3)),
    ("aten.log10.default", torch.log10, (1e-3, 1e3)),
    ("aten.sqrt.default", torch.sqrt, (0.0, 100.0)),
    ("aten.rsqrt.default", torch.rsqrt, (1e-3, 100.0)),
    ("aten.reciprocal.default", torch.reciprocal, (-10.0, 10.0)),
    ("aten.tanh.default", torch.tanh, (-10.0, 10.0)),
    ("aten.sigmoid.default", torch.sigmoid, (-30.0, 30.0)),
    ("aten.silu.default", torch.nn.functional.silu, (-30.0, 30.0)),
    ("aten.gelu.default", torch.nn.functional.gelu, (-10.0, 10.0)),
    ("aten.erf.default", torch.erf, (-4.0, 4.0)),
    ("aten.sin.default", torch.sin, (-10.0, 10.0)),
    ("aten.cos.default", torch.cos, (-10.0, 10.0)),
    ("aten.tan.default", torch.tan, (-1.5, 1.5)),
    ("aten.asin.default", torch.asin, (-1.0, 1.0)),
    ("aten.acos.default", torch.acos, (-1.0, 1.0)),
    ("aten.atan.default", torch.atan, (-9.0, 9.0)),
    ("aten.sinh.default", torch.sinh, (-10.0, 10.0)),
    ("aten.cosh.default", torch.cosh, (-10.0, 10.0)),
    ("aten.asinh.default", torch.asinh, (-100.0, 100.0)),
    ("aten.acosh.default", torch.acosh, (1.0, 100.0)),
    ("aten.atanh.default", torch.atanh, (-0.99, 0.99)),
)
BINARY = (
    ("aten.atan2.default", torch.atan2, (-9.0, 9.0), (-3.0, 5.0)),
    ("aten.pow.Tensor_Tensor", torch.pow, (0.01, 10.0), (-4.0, 4.0)),
    ("aten.hypot.default", torch.hypot, (-9.0, 9.0), (-3.0, 5.0)),
)
# The ops whose lowering uses only primitives tpuc has its own expansion of (own_math.rs): for
# these, switching to tpuc's math can repair a wrong plugin.
REPAIRABLE = frozenset(
    f"aten.{op}.default"
    for op in (
        "exp expm1 log log1p log2 rsqrt tanh sigmoid silu atan atan2 sinh cosh asinh acosh atanh"
    ).split()
)

# Test hook: ATen ops reported wrong as if the plugin had returned a wrong value for them
# (tests/test_own_math.py); the check itself still runs.
simulated_wrong: set[str] = set()


@dataclass
class Report:
    """What the check found: per wrong op, where (dtype, size, index, got, expected)."""

    plugin: str
    cpu: str
    seconds: float = 0.0
    wrong: dict = field(default_factory=dict)
    # Wrong ops that tpuc's own math repaired (checked again after switching).
    repaired: list = field(default_factory=list)
    cached: bool = False
    ops: int = 0


def _sweep(n: int, dtype: torch.dtype, lo: float, hi: float) -> torch.Tensor:
    x = torch.linspace(lo, hi, n, dtype=torch.float64)
    if n >= 17:
        edges = torch.tensor(EDGES, dtype=torch.float64)[: n - 2]
        x[1 : 1 + len(edges)] = edges
    return x.to(dtype)


def _cases(dtype: torch.dtype, only: set[str] | None, sizes=SIZES):
    """(op, function, inputs) for every op and size."""
    out = []
    for op, fn, (lo, hi) in UNARY:
        if only is None or op in only:
            out += [(op, fn, (_sweep(n, dtype, lo, hi),)) for n in sizes]
    for op, fn, (lo, hi), (lo2, hi2) in BINARY:
        if only is None or op in only:
            out += [(op, fn, (_sweep(n, dtype, lo, hi), _sweep(n, dtype, lo2, hi2).flip(0))) for n in sizes]
    return out


def _mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float) -> tuple | None:
    """(index, got, want) of the first wrong element, or None."""
    g, w = got.double(), want.double()
    ok = (g.isnan() & w.isnan()) | (g == w)
    ok |= (g - w).abs() <= rtol * (w.abs() + 1.0)  # absolute near zero, where libms differ most
    ok |= (g == 0) & (w.abs() < torch.finfo(want.dtype).tiny)  # flushed subnormal results
    bad = (~ok).nonzero()
    if bad.numel() == 0:
        return None
    i = int(bad[0, 0])
    return (i, float(g[i]), float(w[i]))


# Ops tpuc lowers only in some dtypes (its erf is float32's): left out of the others' programs.
NOT_LOWERED = {torch.float64: {"aten.erf.default", "aten.gelu.default"}}


def _program(cases: list):
    """(the ATen graph computing every case's function on its inputs, the flat inputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from . import fx_export

    flat = [t for _, _, ins in cases for t in ins]
    arity = [len(ins) for _, _, ins in cases]

    def program(*args):
        outs, k = [], 0
        for (_, fn, _), a in zip(cases, arity, strict=True):
            outs.append(fn(*args[k : k + a]))
            k += a
        return tuple(outs)

    _text, _report, graph, attrs, _rng, _floats = fx_export.export_cleaned(make_fx(program)(*flat))
    if attrs:
        raise _native.TpucError("the known-answer program has constants")
    return graph, flat


def _wrong_ops(
    rt: _native.Runtime, only: set[str] | None = None, sizes=RUN_SIZES, dtypes=RUN_DTYPES
) -> tuple[dict, int]:
    """{op: (dtype, size, index, got, expected)} of the ops the plugin gets wrong, and how many
    ops ran: one program per dtype, compiled in parallel (uncached: the plugin is under test)."""
    from .dtypes import _host_array

    per_dtype = []
    for dtype in dtypes:
        skip = NOT_LOWERED.get(dtype, set())
        cases = [c for c in _cases(dtype, only, sizes) if c[0] not in skip]
        if cases:
            per_dtype.append((dtype, cases, *_program(cases)))
    exes = rt.compile_graphs([graph for _, _, graph, _ in per_dtype], "highest")
    wrong: dict = {}
    ops = set()
    own = set(rt.own_math)  # the simulated wrong answers are the plugin's, not tpuc's math
    for (dtype, cases, _graph, flat), exe in zip(per_dtype, exes, strict=True):
        got = [torch.empty(ins[0].shape, dtype=dtype) for _, _, ins in cases]
        exe.run([_host_array(t) for t in flat], [_host_array(t) for t in got])
        for (op, fn, ins), g in zip(cases, got, strict=True):
            ops.add(op)
            # The reference: PyTorch in float64, rounded once (PyTorch's own float32 kernels
            # have quirks at the edges: gelu(inf) is NaN in its vector code).
            want = fn(*(t.double() for t in ins)).to(dtype)
            m = _mismatch(g, want, RTOL[dtype])
            if m is None and op in simulated_wrong and op not in own:
                m = (0, math.nan, float(want.flatten()[0]))
            if m is not None and op not in wrong:
                wrong[op] = (str(dtype).removeprefix("torch."), ins[0].numel(), *m)
    return wrong, len(ops)


def plugin_name(path: str) -> str:
    """`lammps-jax-pjrt-cpu 0.11.2` for a plugin installed from a wheel, else its path."""
    import importlib.metadata

    dist = Path(path).parent.name.replace("_", "-")
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return str(path)


def _cache_file(rt: _native.Runtime, cache_dir: Path | None) -> Path | None:
    if cache_dir is None:
        return None
    plugin_id, cpu, xla_flags = rt.numerics_identity
    from .version import __version__

    key = hashlib.sha256(f"{SUITE_VERSION}|{__version__}|{plugin_id}|{cpu}|{xla_flags}".encode()).hexdigest()
    return Path(cache_dir) / "known-answers" / f"{key[:32]}.json"


def check(rt: _native.Runtime, cache_dir: Path | None = None, full: bool = False) -> Report:
    """Runs the suite on `rt`'s plugin (or reads the kept result), switches the wrong ops to
    tpuc's own math and checks them again. `full`: every size and dtype (not kept)."""
    sizes, dtypes = (SIZES, DTYPES) if full else (RUN_SIZES, RUN_DTYPES)
    _plugin_id, cpu, _flags = rt.numerics_identity
    report = Report(plugin=plugin_name(rt.plugin_path), cpu=cpu)
    path = None if full else _cache_file(rt, cache_dir)
    if path is not None and path.is_file() and not simulated_wrong:
        try:
            kept = json.loads(path.read_text())
            report.wrong = {k: tuple(v) for k, v in kept["wrong"].items()}
            report.repaired, report.seconds, report.ops = kept["repaired"], kept["seconds"], kept["ops"]
            report.cached = True
            rt.set_own_math(sorted(set(report.wrong) & REPAIRABLE))
            return report
        except (OSError, ValueError, KeyError):
            pass  # an unreadable entry: run the check again
    t0 = time.perf_counter()
    report.wrong, report.ops = _wrong_ops(rt, None, sizes, dtypes)
    repairable = sorted(set(report.wrong) & REPAIRABLE)
    if repairable:
        rt.set_own_math(repairable)
        still, _ = _wrong_ops(rt, set(repairable), sizes, dtypes)
        report.repaired = [op for op in repairable if op not in still]
        rt.set_own_math(report.repaired)
    report.seconds = round(time.perf_counter() - t0, 3)
    if path is not None and not simulated_wrong:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            entry = {"wrong": report.wrong, "repaired": report.repaired, "seconds": report.seconds}
            entry.update(ops=report.ops, plugin=report.plugin, cpu=cpu)
            tmp.write_text(json.dumps(entry, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: the check runs again next time
    return report


def describe(op: str, where: tuple) -> str:
    dtype, size, index, got, want = where
    return f"{op}: {dtype}, {size} elements, element {index} is {got!r} (PyTorch: {want!r})"


_warned: set = set()


def warn(report: Report) -> None:
    """One RuntimeWarning per wrong op, per process."""
    for op, where in sorted(report.wrong.items()):
        if (op, report.plugin) in _warned:
            continue
        _warned.add((op, report.plugin))
        if op in report.repaired:
            then = "tpuc lowers it with its own math expansion from now on (checked right)"
        else:
            then = (
                "tpuc has no expansion that repairs it: its results on this plugin may be wrong; "
                "options={'plugin': 'xla-cpu-pjrt'} selects another CPU plugin"
            )
        warnings.warn(
            f"tpuc: the PJRT plugin {report.plugin} computes {op} wrong on this CPU ({report.cpu}): "
            f"{describe(op, where)}; {then}",
            RuntimeWarning,
            stacklevel=3,
        )


def run_for(rt: _native.Runtime) -> Report | None:
    """The check of a newly created CPU runtime (from runtime.get_runtime): kept result or a fresh
    run, warnings for wrong ops. A check that cannot run (a plugin that fails to compile the
    suite) warns and leaves the plugin's math in use."""
    from . import options as options_mod

    try:
        report = check(rt, options_mod.parse({}).cache_dir)
    except Exception as e:  # noqa: BLE001 - a check that cannot run must not stop compiling
        warnings.warn(
            f"tpuc: the known-answer check of {rt.plugin_path} could not run: {e}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    warn(report)
    return report
