"""Long differential fuzzing runs with a report.

    python tests/fuzz/cli.py --count 10000 [--start 0] [--report fuzz_report.json] [--save]
        [--dynamic | --dynamic-count N]

Programs run in worker subprocesses, so that a process abort (SIGABRT, SIGSEGV) is recorded as a
crash of the program that caused it and the run goes on. --save shrinks each failure and writes it
as a regression test under tests/fuzz/regressions/."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def worker(start: int, end: int, include_known: bool, dynamic_end: int) -> None:
    """Runs seeds [start, end); one JSON line per program on stdout, a `begin` line before each.
    Seeds below `dynamic_end` also run in the dynamic-dims mode."""
    import tempfile

    os.environ.setdefault("TPUC_CACHE_DIR", tempfile.mkdtemp(prefix="tpuc-fuzz-"))
    import random

    from fuzz.gen import generate
    from fuzz.runner import run, run_dynamic

    for seed in range(start, end):
        print(json.dumps({"begin": seed}), flush=True)
        program = generate(seed, include_known=include_known)
        modes = ["static", "dynamic"] if seed < dynamic_end else ["static"]
        for mode in modes:
            t0 = time.perf_counter()
            if mode == "static":
                outcome = run(program)
            else:
                rng = random.Random(seed)
                sizes = (rng.randint(2, 16), rng.randint(2, 16))
                outcome = run_dynamic(program, sizes, include_known=include_known)
            record = {
                "seed": seed,
                "mode": mode,
                "kind": outcome.kind,
                "type": outcome.error_type,
                "detail": outcome.detail,
                "seconds": round(time.perf_counter() - t0, 3),
                "nodes": len(program.nodes),
            }
            print(json.dumps(record), flush=True)


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _report(args, argv, results, started, t0, dynamic_end, complete, commit, batches):
    kinds = collections.Counter(r["kind"] for r in results)
    errors = collections.Counter(r["type"] for r in results if r["kind"] == "error")
    bad = [r for r in results if r["kind"] in ("mismatch", "internal", "crash")]
    report = {
        "command": " ".join(["python", "tests/fuzz/cli.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit,
        "started_utc": started,
        "complete": complete,
        "seeds": [args.start, args.start + args.count],
        "dynamic_seeds": [args.start, dynamic_end],
        "batches_run": batches,
        "programs": len({r["seed"] for r in results}),
        "runs": len(results),
        "static_runs": collections.Counter(r["kind"] for r in results if r.get("mode") != "dynamic"),
        "dynamic_runs": collections.Counter(r["kind"] for r in results if r.get("mode") == "dynamic"),
        "seconds": round(time.time() - t0, 1),
        "ok": kinds["ok"],
        "crashes": kinds["crash"],
        "silent_mismatches": kinds["mismatch"],
        "internal_errors": kinds["internal"],
        "clear_errors": dict(errors),
        "invalid": kinds["invalid"],  # dynamic runs whose dim Dynamo specialized, or no dim to mark
        "failures": bad,
        "errors": [
            {k: r.get(k) for k in ("seed", "mode", "type", "detail")} for r in results if r["kind"] == "error"
        ],
        "error_examples": {t: next(r["detail"] for r in results if r["type"] == t) for t in errors},
    }
    return report, bad


def _claim(directory: str, seed: int) -> bool:
    """True if this run is the first to claim the batch starting at `seed` (exclusive create)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    try:
        with open(Path(directory) / f"batch{seed}", "x") as f:
            f.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False


SUMMED = ("programs", "runs", "ok", "crashes", "silent_mismatches", "internal_errors", "invalid")
COUNTED = ("static_runs", "dynamic_runs", "clear_errors")


def merge(reports: list[dict]) -> dict:
    """One report for runs that together covered disjoint seeds (their parts listed in `parts`)."""
    out: dict = {"parts": []}
    for r in reports:
        part = {
            k: r.get(k) for k in ("command", "commit", "started_utc", "complete", "seeds", "dynamic_seeds")
        }
        part.update({k: r.get(k) for k in ("programs", "seconds", "batches_run")})
        out["parts"].append(part)
    for k in SUMMED:
        out[k] = sum(r.get(k, 0) for r in reports)
    for k in COUNTED:
        total: collections.Counter = collections.Counter()
        for r in reports:
            total.update(r.get(k, {}))
        out[k] = dict(total)
    out["complete"] = all(r.get("complete") for r in reports)
    out["failures"] = [f for r in reports for f in r.get("failures", [])]
    out["errors"] = [f for r in reports for f in r.get("errors", [])]
    examples: dict = {}
    for r in reports:
        for t, d in r.get("error_examples", {}).items():
            examples.setdefault(t, d)
    out["error_examples"] = examples
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--batch", type=int, default=500, help="programs per worker process")
    ap.add_argument("--report", default="fuzz_report.json")
    ap.add_argument("--save", action="store_true", help="shrink failures into tests/fuzz/regressions/")
    ap.add_argument("--include-known", action="store_true", help="also generate known (xfail) bugs")
    ap.add_argument(
        "--dynamic",
        action="store_true",
        help="also run each program with dim 0 marked dynamic (max 16, buckets) at two sizes",
    )
    ap.add_argument(
        "--dynamic-count",
        type=int,
        help="like --dynamic, for the first N programs only (the others run static only)",
    )
    ap.add_argument(
        "--claim-dir",
        help="share the seeds with other runs given the same directory: each run takes the next "
        "batch no run has claimed yet (a file per batch in DIR)",
    )
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="combine reports of runs into --report")
    ap.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker[:2], args.include_known, args.worker[2])
        return 0
    if args.merge:
        report = merge([json.loads(Path(p).read_text()) for p in args.merge])
        Path(args.report).write_text(json.dumps(report, indent=2))
        print(
            json.dumps(
                {k: v for k, v in report.items() if k not in ("failures", "errors", "error_examples")},
                indent=2,
            )
        )
        return 0

    dynamic_end = args.start
    if args.dynamic:
        dynamic_end = args.start + args.count
    if args.dynamic_count is not None:
        dynamic_end = args.start + min(args.dynamic_count, args.count)
    commit = _git_commit()  # of the code under test, at the start
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.time()
    results, crashes, batches = [], [], []
    seed, end = args.start, args.start + args.count
    batch_end = None
    while seed < end:
        if batch_end is None or seed >= batch_end:  # a new batch, at start + k * batch
            if args.claim_dir and not _claim(args.claim_dir, seed):
                seed += args.batch  # another run took it
                continue
            batch_end = min(seed + args.batch, end)
            batches.append([seed, batch_end])
        stop = batch_end
        cmd = [sys.executable, __file__, "--worker", str(seed), str(stop), str(dynamic_end)]
        if args.include_known:
            cmd.append("--include-known")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current = None
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # anything a program printed
            if "begin" in rec:
                current = rec["begin"]
            else:
                results.append(rec)
                if rec.get("mode") != "static" or rec["seed"] >= dynamic_end:
                    current = None
        rc = proc.wait()
        if current is not None:  # the worker died inside a program: a crash
            crashes.append({"seed": current, "returncode": rc})
            results.append({"seed": current, "kind": "crash", "type": f"exit {rc}", "detail": ""})
            seed = current + 1
        else:
            seed = stop
        done = len({r["seed"] for r in results})
        partial, _ = _report(
            args, argv, results, started, t0, dynamic_end, complete=False, commit=commit, batches=batches
        )
        Path(args.report).write_text(json.dumps(partial, indent=2))  # progress survives an interruption
        print(f"\r{done}/{args.count} programs, {time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    report, bad = _report(
        args, argv, results, started, t0, dynamic_end, complete=True, commit=commit, batches=batches
    )
    if args.save and bad:
        from fuzz.gen import generate
        from fuzz.runner import run, save_regression, shrink

        for r in bad:
            if r["kind"] == "crash":
                continue  # a crash would kill this process too: its seed is in the report
            program = generate(r["seed"], include_known=args.include_known)
            outcome = run(program)
            if outcome.bad:
                small, small_outcome = shrink(program, outcome)
                r["regression"] = str(save_regression(small, small_outcome, f"seed{r['seed']}"))
    Path(args.report).write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if k not in ("failures", "errors", "error_examples")}
    print(json.dumps(summary, indent=2))
    for r in bad[:20]:
        print(f"  seed {r['seed']}: {r['kind']} {r.get('type', '')} {r.get('detail', '')[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
