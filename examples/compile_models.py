"""Compile the four reference models with tpuc and check them against eager PyTorch.

For each model of tests/models.py (mlp, preln, postln, convnet), in float32 and inference mode,
this example runs `torch.compile(model, backend="tpu")`, checks the result against eager
(rtol=atol=1e-5), and prints the max abs error, the first-call time (Dynamo tracing + tpuc lowering
+ XLA compile) and the steady-state median latency. It ends with `tpuc.stats()`.

Then the TPU road: one model compiled for a TPU slice without a TPU (libtpu's compile-only
topology, `options={"target": TPU_TARGET}`), with XLA:TPU's memory per chip for each of its
executables, and the very same target-lowered graphs run through the CPU stand-in
(`"stand_in": "cpu"`) and checked against eager.

It exits non-zero if any model mismatches eager, if XLA compiled nothing, or if any op fell back to
eager PyTorch.

    .venv/bin/python examples/compile_models.py      # or: make run
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import models  # noqa: E402  (tests/models.py)

import tpuc  # noqa: E402

STEADY_CALLS = 50
# The TPU slice of the TPU road's part, and its model (tests/models.py).
TPU_TARGET = "tpu:v5e:2x2"
TPU_MODEL = "preln"


def run_model(name: str) -> dict:
    """Compiles one model, checks it against eager and times it."""
    model, inputs = models.make(name, torch.float32)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(*inputs)
        compiled = torch.compile(model, backend="tpu")

        t0 = time.perf_counter()
        actual = compiled(*inputs)
        first_call_s = time.perf_counter() - t0

        times = []
        for _ in range(STEADY_CALLS):
            t0 = time.perf_counter()
            compiled(*inputs)
            times.append(time.perf_counter() - t0)

    result = {
        "model": name,
        "max_abs_err": (actual - expected).abs().max().item(),
        "first_call_s": first_call_s,
        "median_ms": statistics.median(times) * 1e3,
        "error": None,
    }
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        result["error"] = str(e)
    return result


def run_tpu_road(cache_dir: str) -> dict:
    """TPU_MODEL precompiled for TPU_TARGET (memory per chip from XLA:TPU's plan), then run
    through the CPU stand-in and checked against eager."""
    model, inputs = models.make(TPU_MODEL, torch.float32)
    options = {"target": TPU_TARGET, "cache_dir": cache_dir}
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(*inputs)
        t0 = time.perf_counter()
        report = tpuc.precompile(model, inputs, options=options)
        precompile_s = time.perf_counter() - t0
        torch._dynamo.reset()
        stand_in = torch.compile(model, backend="tpu", options={**options, "stand_in": "cpu"})
        actual = stand_in(*inputs)
    result = {"report": report, "precompile_s": precompile_s, "error": None}
    result["max_abs_err"] = (actual - expected).abs().max().item()
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        result["error"] = str(e)
    return result


def main() -> int:
    tpuc.reset_stats()
    results = []
    for name in models.NAMES:
        try:
            results.append(run_model(name))
        except Exception as e:  # a crash in one model should not hide the others
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"})

    print(f"{'model':<10} {'max abs err':>12} {'first call s':>13} {'median ms':>10}  status")
    for r in results:
        if "median_ms" in r:
            row = f"{r['model']:<10} {r['max_abs_err']:>12.2e} {r['first_call_s']:>13.3f} {r['median_ms']:>10.3f}"
        else:
            row = f"{r['model']:<10} {'-':>12} {'-':>13} {'-':>10}"
        print(f"{row}  {'ok' if r['error'] is None else 'FAIL'}")

    print(f"\nTPU road: {TPU_MODEL} for {TPU_TARGET} (compile-only, no TPU needed)")
    with tempfile.TemporaryDirectory() as cache_dir:
        try:
            tpu = run_tpu_road(cache_dir)
        except Exception as e:  # reported like a model's failure
            tpu = {"error": f"{type(e).__name__}: {e}"}
    if "report" in tpu:
        for g in tpu["report"]["per_graph"]:
            print(
                f"  executable {g['name']}: {g['devices']} chips, "
                f"{g['footprint_bytes'] / 2**20:.2f} MiB per chip, compiled in {g['compile_seconds']:.1f} s"
            )
        print(
            f"  precompile {tpu['precompile_s']:.1f} s; through the CPU stand-in: max abs err {tpu['max_abs_err']:.2e}"
        )
    print(f"  {'ok' if tpu['error'] is None else 'FAIL'}")

    stats = tpuc.stats()
    print("\ntpuc.stats():")
    for key, value in stats.items():
        print(f"  {key}: {value}")

    problems = [f"{r['model']}: {r['error']}" for r in results if r["error"] is not None]
    if tpu["error"] is not None:
        problems.append(f"TPU road ({TPU_MODEL} for {TPU_TARGET}): {tpu['error']}")
    if stats["xla_compiles"] + stats["cache_hits_memory"] + stats["cache_hits_disk"] == 0:
        problems.append("no executable was compiled by XLA or loaded from a cache")
    if stats["fallback_ops"]:
        problems.append(f"ops fell back to eager PyTorch: {stats['fallback_ops']}")
    if problems:
        print("\nFAILED:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print("\nall models match eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
