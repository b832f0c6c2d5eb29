"""The long form of the stress runs (tests/stress_runs.py; `make test` runs a short one): zoo
models compiled with backend="tpu" in many fresh processes, with another core busy, every call of
every process compared with eager (first and steady calls), every process's exit status read,
and the processes of one model compared with each other bit for bit.

    .venv/bin/python bench/stress.py [--runs 10] [--train resnet18 gpt2 ...] [--infer resnet18 ...]

Prints one row per model and mode (runs, runs off eager, aborts or other non-zero exits,
distinct results, seconds per run) and writes the table on top of bench/results/stress.md (earlier runs below it),
with the raw runs in bench/results/stress.json. Exit status 1 when any run was off eager, exited
abnormally, or the runs of one model disagreed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
# Fresh caches for every run of this script (children inherit them): a run must compile.
os.environ.setdefault("TPUC_CACHE_DIR", tempfile.mkdtemp(prefix="tpuc-stress-"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tpuc-stress-torch-"))

import results_history  # noqa: E402  (bench/, beside this script)
import stress_runs  # noqa: E402

# The training models of tests/test_zoo_training.py and a spread of inference models (CNNs with
# host convolutions, decoders and encoders with host matrix products and attention).
TRAIN = ["resnet18", "gpt2", "llama", "bert", "vit"]
INFER = ["resnet18", "mobilenet_v2", "efficientnet_b0", "convnext", "gpt2", "bert", "t5"]


def _row(runs: list[stress_runs.Run]) -> dict:
    return {
        "model": runs[0].model,
        "mode": runs[0].mode,
        "runs": len(runs),
        "off_eager": sum(1 for r in runs if r.returncode == 0 and not all(r.ok)),
        "bad_exit": sum(1 for r in runs if r.returncode != 0),
        "distinct_results": len({r.digest for r in runs if r.digest}),
        # Processes whose steady calls did not give the first call's bits.
        "steady_differs": sum(1 for r in runs if len(set(r.digests)) > 1),
        "worst_error": max((max(r.errors) for r in runs if r.errors), default=float("nan")),
        "seconds_per_run": sum(r.seconds for r in runs) / len(runs),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="fresh processes per model and mode")
    ap.add_argument("--train", nargs="*", default=TRAIN)
    ap.add_argument("--infer", nargs="*", default=INFER)
    ap.add_argument("--no-busy", action="store_true", help="leave the other core idle")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    cases = [(m, "train") for m in args.train] + [(m, "infer") for m in args.infer]
    rows, raw = [], []
    t0 = time.perf_counter()
    for model, mode in cases:
        runs = []
        for k in range(args.runs):
            if args.no_busy:
                r = stress_runs.run_once(model, mode)
            else:
                with stress_runs.busy_core():
                    r = stress_runs.run_once(model, mode)
            runs.append(r)
            status = "ok" if r.clean else f"FAIL (exit {r.returncode}, ok {r.ok}, worst {r.worst})"
            print(f"{model} {mode} run {k + 1}/{args.runs}: {status} {r.seconds:.1f} s", flush=True)
            if not r.clean:
                print(r.stderr_tail, flush=True)
        rows.append(_row(runs))
        raw += [vars(r) for r in runs]
    load = os.getloadavg()[0]
    header = (
        "| model | mode | runs | off eager | bad exits | distinct results | steady calls differ | worst error (rel.) | s/run |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "".join(
        f"| {r['model']} | {r['mode']} | {r['runs']} | {r['off_eager']} | {r['bad_exit']} | "
        f"{r['distinct_results']} | {r['steady_differs']} | {r['worst_error']:.1e} | {r['seconds_per_run']:.1f} |\n"
        for r in rows
    )
    print(table)
    busy = "the other core idle" if args.no_busy else "the other core busy"
    latest = (
        f"# Stress runs: {args.runs} fresh processes per row, {busy} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"`python bench/stress.py --runs {args.runs}`; {time.perf_counter() - t0:.0f} s in all, "
        f"load average at the end {load:.1f}.\n\n{table}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results_history.write_markdown(args.out / "stress.md", latest)
    (args.out / "stress.json").write_text(json.dumps({"rows": rows, "runs": raw}, indent=1) + "\n")
    bad = any(
        r["off_eager"] or r["bad_exit"] or r["distinct_results"] > 1 or r["steady_differs"] for r in rows
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
