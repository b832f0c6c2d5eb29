"""tpuc's own math expansions (compiler/src/lower/emit/own_math.rs) against eager PyTorch, at sizes that
reach the plugin's vector code, and their use for ops the known-answer check finds wrong."""

from __future__ import annotations

import math

import pytest
import torch

SIZES = (1, 17, 64, 1000, 4099)
# Relative tolerance per dtype: f32/bf16 results are computed in f64 and rounded once (eager
# computes in f32), so they may differ by one unit in the last place.
RTOL = {torch.float32: 2e-7, torch.float64: 1e-15, torch.bfloat16: 8e-3}
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e30, -1e30, 1e-30, -1e-30, 1e300, -1e300]
# No subnormals: XLA's CPU code flushes them to zero (a documented difference for every op).
EDGES += [1e-300, 2.3e-308, 1.0, -1.0, 0.66, 2.414, 3.4e38, 1.2e-38]


def _values(n: int, dtype: torch.dtype, lo: float = -9.0, hi: float = 9.0) -> torch.Tensor:
    x = torch.linspace(lo, hi, n, dtype=torch.float64)
    edges = torch.tensor(EDGES, dtype=torch.float64)[: max(0, n - 2)]
    x[1 : 1 + len(edges)] = edges
    return x.to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    same_nan = g.isnan() == w.isnan()
    assert bool(same_nan.all()), f"NaN at {(~same_nan).nonzero().flatten()[:8].tolist()}"
    ok = w.isnan() | (g == w) | ((g - w).abs() <= rtol * w.abs())
    # A subnormal result may be flushed to zero (XLA's CPU code runs with FTZ).
    ok |= (g == 0) & (w.abs() < torch.finfo(want.dtype).tiny)
    # Signs of zeros and infinities matter (atan2's quadrants).
    ok &= w.isnan() | (torch.signbit(g) == torch.signbit(w))
    bad = (~ok).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {g.numel()} differ, first at {bad[:8].tolist()}: "
        f"{g[bad[:4]].tolist()} vs eager {w[bad[:4]].tolist()}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_atan_matches_eager(dtype):
    f = torch.compile(torch.atan, backend="tpu", dynamic=False)
    for n in SIZES:
        x = _values(n, dtype)
        _close(f(x), torch.atan(x), RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_atan2_matches_eager(dtype):
    f = torch.compile(torch.atan2, backend="tpu", dynamic=False)
    g = torch.compile(lambda y: torch.atan2(y, torch.ones_like(y)), backend="tpu", dynamic=False)
    for n in SIZES:
        y = _values(n, dtype)
        x = _values(n, dtype, -3.0, 5.0).flip(0)
        _close(f(y, x), torch.atan2(y, x), RTOL[dtype])
        # atan2(y, 1): the form the default plugin's LLVM turned into its broken vector atan.
        _close(g(y), torch.atan2(y, torch.ones_like(y)), RTOL[dtype])
    # Every pair of special values: the quadrants, zeros' signs, infinities and NaN.
    special = torch.tensor(EDGES, dtype=dtype)
    yy, xx = torch.meshgrid(special, special, indexing="ij")
    _close(f(yy.flatten(), xx.flatten()), torch.atan2(yy.flatten(), xx.flatten()), RTOL[dtype])


def _exp_module(tmp_path, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    torch._dynamo.reset()
    f = torch.compile(torch.exp, backend="tpu", options={"dump_dir": str(tmp_path), "cache_dir": None})
    y = f(x)
    (mlir,) = [p.read_text() for p in tmp_path.rglob("stablehlo.mlir")]
    return y, mlir


def test_an_op_the_check_finds_wrong_is_lowered_with_tpucs_math(tmp_path):
    """The known-answer check's result switches the op to tpuc's expansion: a plugin result
    declared wrong by the test hook (`simulated_wrong`), not a mocked plugin."""
    from tpuc import conformance, runtime

    rt = runtime.get_runtime(None)
    if rt.platform != "cpu":
        pytest.skip("the check runs on CPU plugins")
    before = rt.own_math
    x = _values(4099, torch.float32, -80.0, 80.0)
    conformance.simulated_wrong.add("aten.exp.default")
    try:
        report = conformance.check(rt, None)
        with pytest.warns(RuntimeWarning, match=r"computes aten\.exp\.default wrong on this CPU \(x86_64"):
            conformance.warn(report)
        assert "aten.exp.default" in report.wrong and report.repaired == ["aten.exp.default"]
        assert rt.own_math == ["aten.exp.default"]
        y, mlir = _exp_module(tmp_path / "own", x)
    finally:
        conformance.simulated_wrong.clear()
        conformance._warned.clear()
        rt.set_own_math(before)
    # tpuc's expansion (no plugin exp left in the module), and still PyTorch's numbers.
    assert "stablehlo.exponential" not in mlir and "stablehlo.shift_left" in mlir
    _close(y, torch.exp(x), RTOL[torch.float32])
    # Back to the plugin's exp once the op is no longer listed.
    y, mlir = _exp_module(tmp_path / "plugin", x)
    assert "stablehlo.exponential" in mlir
    _close(y, torch.exp(x), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_own_expansions_match_eager(tmp_path, dtype):
    """Every primitive tpuc can expand itself, through the ops that use them, at vector sizes and
    edge values."""
    from tpuc import conformance, runtime

    rt = runtime.get_runtime(None)
    ops = {
        "aten.exp.default": (torch.exp, -80.0, 80.0),
        "aten.expm1.default": (torch.expm1, -5.0, 5.0),
        "aten.log.default": (torch.log, 1e-3, 1e3),
        "aten.log1p.default": (torch.log1p, -0.99, 10.0),
        "aten.tanh.default": (torch.tanh, -10.0, 10.0),
        "aten.sigmoid.default": (torch.sigmoid, -30.0, 30.0),
        "aten.rsqrt.default": (torch.rsqrt, 1e-3, 100.0),
    }
    before = rt.own_math
    rt.set_own_math(list(ops))
    try:
        for fn, lo, hi in ops.values():
            torch._dynamo.reset()
            f = torch.compile(fn, backend="tpu", options={"cache_dir": None})
            for n in (17, 4099):
                x = _values(n, dtype, lo, hi)
                # The reference in float64, rounded once; our expansions are evaluated in f64.
                _close(f(x), fn(x.double()).to(dtype), 4 * RTOL[dtype])
    finally:
        rt.set_own_math(before)
    assert conformance.REPAIRABLE >= set(ops)


def test_known_answer_check_passes_on_this_cpu():
    """The check at run time on this machine's default CPU plugin: every op right, or repaired by
    tpuc's own math (what `make test` reports for CI's CPU)."""
    from tpuc import conformance, runtime

    rt = runtime.get_runtime(None)
    if rt.platform != "cpu":
        pytest.skip("the check runs on CPU plugins")
    report = conformance.check(rt, None)
    assert report.ops >= 25
    unrepaired = {
        op: conformance.describe(op, w) for op, w in report.wrong.items() if op not in report.repaired
    }
    assert not unrepaired, f"{report.plugin} on {report.cpu}: {unrepaired}"
    assert rt.own_math == sorted(report.repaired)
