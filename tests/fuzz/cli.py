"""Long differential fuzzing runs with a report.

    python tests/fuzz/cli.py --count 10000 [--start 0] [--report fuzz_report.json] [--save]
        [--dynamic | --dynamic-count N] [--stateful | --family classic|stateful|mixed]
        [--markdown fuzz_report.md]

Families: `classic` (gen.py's programs, static and optionally with dynamic dims), `stateful`
(stateful.py: modules whose parameters and buffers are changed between calls, even seeds; gen.py
programs with custom ops that tpuc partitions around, customops.py, odd seeds), `mixed` (each seed
runs both). Programs run in worker subprocesses, so that a process abort (SIGABRT, SIGSEGV) is
recorded as a crash of the program that caused it and the run goes on. --save shrinks each failure
and writes it as a regression test under tests/fuzz/regressions/."""

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


FAMILIES = ("classic", "stateful", "mixed")
BAD = ("mismatch", "internal", "crash")


def worker(
    start: int, end: int, include_known: bool, dynamic_end: int, family: str = "classic", only=None
) -> None:
    """Runs seeds [start, end); one JSON line per run on stdout, a `begin` line before each run
    and an `end` line after each seed. Seeds below `dynamic_end` also run in the dynamic-dims mode
    (classic family)."""
    import tempfile
    import warnings

    os.environ.setdefault("TPUC_CACHE_DIR", tempfile.mkdtemp(prefix="tpuc-fuzz-"))
    warnings.simplefilter("ignore")  # fallback and deprecation warnings would flood stderr
    import random

    from fuzz.gen import generate
    from fuzz.runner import run, run_dynamic

    for seed in range(start, end):
        if family in ("classic", "mixed"):
            program = generate(seed, include_known=include_known)
            modes = ["static", "dynamic"] if seed < dynamic_end else ["static"]
            for mode in modes:
                print(json.dumps({"begin": seed, "mode": mode}), flush=True)
                t0 = time.perf_counter()
                if mode == "static":
                    outcome = run(program)
                else:
                    rng = random.Random(seed)
                    sizes = (rng.randint(2, 16), rng.randint(2, 16))
                    outcome = run_dynamic(program, sizes, include_known=include_known)
                print(json.dumps(_record(seed, mode, outcome, t0, nodes=len(program.nodes))), flush=True)
        if family in ("stateful", "mixed"):
            from fuzz.stateful import failure_blame, generate_stateful, mode_of, program_kinds, run_stateful

            t0 = time.perf_counter()
            print(json.dumps({"begin": seed, "mode": "stateful"}), flush=True)  # generation runs eager
            program = generate_stateful(seed, only)
            mode = mode_of(program)
            print(json.dumps({"begin": seed, "mode": mode}), flush=True)
            outcome = run_stateful(program)
            record = _record(seed, mode, outcome, t0, kinds=program_kinds(program))
            if outcome.kind in BAD or outcome.kind == "torch":
                record["blame"] = failure_blame(program, outcome)
            print(json.dumps(record), flush=True)
        print(json.dumps({"end": seed}), flush=True)


def _record(seed: int, mode: str, outcome, t0: float, **extra) -> dict:
    """One program's JSON line: seed, mode, outcome and the seconds since `t0`."""
    return {
        "seed": seed,
        "mode": mode,
        "kind": outcome.kind,
        "type": outcome.error_type,
        "detail": outcome.detail,
        "seconds": round(time.perf_counter() - t0, 3),
        **extra,
    }


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
    bad = [r for r in results if r["kind"] in BAD]
    by_mode: dict = {}
    for r in results:
        by_mode.setdefault(r.get("mode", "?"), collections.Counter())[r["kind"]] += 1
    # New family: how many programs used each mutation kind / custom op, and how many failures
    # are blamed on each (the mutations right before the failing call; a program's custom ops).
    seen = collections.Counter(k for r in results for k in r.get("kinds", []))
    blamed = collections.Counter(k for r in bad for k in r.get("blame", []))
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
        "static_runs": collections.Counter(r["kind"] for r in results if r.get("mode", "static") == "static"),
        "dynamic_runs": collections.Counter(r["kind"] for r in results if r.get("mode") == "dynamic"),
        "family": getattr(args, "family", "classic"),
        "runs_by_mode": {m: dict(c) for m, c in by_mode.items()},
        "kinds_seen": dict(seen),
        "failures_by_kind": dict(blamed),
        "torch": kinds["torch"],  # failures that backend="aot_eager" shows too (not tpuc's)
        "seconds": round(time.time() - t0, 1),
        "ok": kinds["ok"],
        "crashes": kinds["crash"],
        "silent_mismatches": kinds["mismatch"],
        "internal_errors": kinds["internal"],
        "clear_errors": dict(errors),
        # dynamic runs whose dim Dynamo specialized, or no dim to mark; stateful programs eager
        # PyTorch itself rejected
        "invalid": kinds["invalid"],
        "failures": bad,
        "errors": [
            {k: r.get(k) for k in ("seed", "mode", "type", "detail")} for r in results if r["kind"] == "error"
        ],
        "torch_failures": [r for r in results if r["kind"] == "torch"],
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


SUMMED = ("programs", "runs", "ok", "crashes", "silent_mismatches", "internal_errors", "invalid", "torch")
COUNTED = ("static_runs", "dynamic_runs", "clear_errors", "kinds_seen", "failures_by_kind")


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
    by_mode: dict = {}
    for r in reports:
        for mode, counts in r.get("runs_by_mode", {}).items():
            by_mode.setdefault(mode, collections.Counter()).update(counts)
    out["runs_by_mode"] = {m: dict(c) for m, c in by_mode.items()}
    out["family"] = ",".join(sorted({r.get("family", "classic") for r in reports}))
    out["complete"] = all(r.get("complete") for r in reports)
    out["failures"] = [f for r in reports for f in r.get("failures", [])]
    out["torch_failures"] = [f for r in reports for f in r.get("torch_failures", [])]
    out["errors"] = [f for r in reports for f in r.get("errors", [])]
    examples: dict = {}
    for r in reports:
        for t, d in r.get("error_examples", {}).items():
            examples.setdefault(t, d)
    out["error_examples"] = examples
    return out


def markdown(report: dict) -> str:
    """A Markdown summary of a report (the tables of bench/results/fuzz_long.md)."""
    modes = report.get("runs_by_mode", {})
    kinds = ["ok", "mismatch", "internal", "crash", "error", "torch", "invalid"]
    names = {
        "ok": "equal to eager",
        "mismatch": "**silent mismatches**",
        "internal": "**internal errors** (unclassified exceptions)",
        "crash": "**crashes** (worker process died)",
        "error": "clear errors (tpuc errors naming the problem)",
        "torch": "failures `aot_eager` shows too (PyTorch's, not tpuc's)",
        "invalid": "not applicable (dim specialized; eager rejects)",
    }
    order = [m for m in ("static", "dynamic", "module", "customop") if m in modes]
    order += [m for m in modes if m not in order]
    lines = [
        f"# Differential fuzz run: {report.get('family', 'classic')} family",
        "",
        f"Command: `{report.get('command', '')}`  ",
        f"Commit: {report.get('commit', '?')}, started {report.get('started_utc', '?')}, "
        f"{report.get('seconds', '?')} s, complete: {report.get('complete')}, seeds {report.get('seeds')}",
        "",
        "| | " + " | ".join(order) + " | total |",
        "|---|" + "---:|" * (len(order) + 1),
        f"| runs | {' | '.join(str(sum(modes[m].values())) for m in order)} | {report.get('runs', 0)} |",
    ]
    for k in kinds:
        row = [modes[m].get(k, 0) for m in order]
        if any(row):
            lines.append(f"| {names[k]} | {' | '.join(f'{v:,}' for v in row)} | {sum(row):,} |")
    if report.get("clear_errors"):
        lines += [
            "",
            "Clear errors by type: " + ", ".join(f"`{t}` {n}" for t, n in report["clear_errors"].items()),
        ]
    seen = report.get("kinds_seen", {})
    if seen:
        blamed = report.get("failures_by_kind", {})
        lines += [
            "",
            "Stateful family, by mutation kind / input policy (module programs) and custom op "
            "(custom-op programs): programs that used it, and failures blamed on it (what changed "
            "right before the failing call; a custom-op program's ops):",
            "",
            "| kind | programs | failures blamed |",
            "|---|---:|---:|",
        ]
        for k in sorted(seen, key=lambda k: (-blamed.get(k, 0), k)):
            lines.append(f"| `{k}` | {seen[k]:,} | {blamed.get(k, 0):,} |")
    failures = report.get("failures", [])
    if failures:
        lines += ["", f"Failures ({len(failures)}):", ""]
        for r in failures[:200]:
            blame = f" [{', '.join(r['blame'])}]" if r.get("blame") else ""
            reg = f" -> `{r['regression']}`" if r.get("regression") else ""
            lines.append(
                f"- seed {r['seed']} ({r.get('mode', '?')}): {r['kind']} {r.get('type', '')}{blame}: "
                f"{r.get('detail', '')[:240]}{reg}"
            )
    torch_f = report.get("torch_failures", [])
    if torch_f:
        lines += ["", f"Failures that `aot_eager` shows too ({len(torch_f)}, not counted):", ""]
        lines += [f"- seed {r['seed']} ({r.get('mode')}): {r.get('detail', '')[:240]}" for r in torch_f[:50]]
    return "\n".join(lines) + "\n"


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
    ap.add_argument(
        "--family",
        choices=FAMILIES,
        default="classic",
        help="classic: gen.py's programs; stateful: modules mutated between calls and programs with "
        "custom ops (stateful.py, customops.py); mixed: both for every seed",
    )
    ap.add_argument("--stateful", action="store_true", help="same as --family stateful")
    ap.add_argument(
        "--kinds",
        help="stateful family: module programs only, whose mutations are only these kinds "
        "(comma-separated, e.g. data_assign,swap_tensors,input:reuse_data_assign; see stateful.py)",
    )
    ap.add_argument("--markdown", metavar="PATH", help="also write a Markdown summary of the report")
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="combine reports of runs into --report")
    ap.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stateful or args.kinds:
        args.family = "stateful"
    only = None
    if args.kinds:
        from fuzz.stateful import ALL_KINDS, INPUT_POLICIES

        only = set(args.kinds.split(","))
        unknown = only - set(ALL_KINDS) - {f"input:{p}" for p in INPUT_POLICIES}
        if unknown:
            ap.error(f"unknown kinds {sorted(unknown)}")
    if args.worker:
        worker(*args.worker[:2], args.include_known, args.worker[2], args.family, only)
        return 0
    if args.merge:
        report = merge([json.loads(Path(p).read_text()) for p in args.merge])
        Path(args.report).write_text(json.dumps(report, indent=2))
        if args.markdown:
            Path(args.markdown).write_text(markdown(report))
        print(
            json.dumps(
                {
                    k: v
                    for k, v in report.items()
                    if k not in ("failures", "errors", "error_examples", "torch_failures")
                },
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
        cmd += ["--family", args.family] + (["--kinds", args.kinds] if args.kinds else [])
        if args.include_known:
            cmd.append("--include-known")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current = current_mode = None
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # anything a program printed
            if not isinstance(rec, dict):
                continue
            if "begin" in rec:
                current, current_mode = rec["begin"], rec.get("mode")
            elif "end" in rec:
                current = current_mode = None
            elif "seed" in rec and "kind" in rec:
                results.append(rec)
                current_mode = None  # between the runs of one seed
        rc = proc.wait()
        if current is not None:  # the worker died inside a seed: a crash (of its mode's run)
            crashes.append({"seed": current, "returncode": rc})
            results.append(
                {
                    "seed": current,
                    "mode": current_mode or "?",
                    "kind": "crash",
                    "type": f"exit {rc}",
                    "detail": "",
                }
            )
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
            if r.get("mode") in ("module", "customop"):
                from fuzz import stateful

                program = stateful.generate_stateful(r["seed"], only)
                outcome = stateful.run_stateful(program)
                if outcome.bad:
                    small, small_outcome = stateful.shrink_stateful(program, outcome)
                    name = f"{r['mode']}_seed{r['seed']}"
                    r["regression"] = str(stateful.save_regression(small, small_outcome, name))
                continue
            program = generate(r["seed"], include_known=args.include_known)
            outcome = run(program)
            if outcome.bad:
                small, small_outcome = shrink(program, outcome)
                r["regression"] = str(save_regression(small, small_outcome, f"seed{r['seed']}"))
    Path(args.report).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    summary = {
        k: v for k, v in report.items() if k not in ("failures", "errors", "error_examples", "torch_failures")
    }
    print(json.dumps(summary, indent=2))
    for r in bad[:20]:
        print(f"  seed {r['seed']}: {r['kind']} {r.get('type', '')} {r.get('detail', '')[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
