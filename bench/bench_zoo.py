"""Every zoo model (tests/zoo.py) under eager PyTorch, Inductor and tpuc: first call, steady-state
median and p99 latency, peak resident memory; a table and a plot of the latency ratios.

Per model:

* one process per backend (eager, Inductor, tpuc), with fresh, empty compile caches: the first
  call (Dynamo + AOTAutograd + the backend's compile + one run; for eager, the first run), 20
  more calls, and the process's peak RSS (`ru_maxrss`). The processes run one after another, so
  their RSS do not mix.
* one process running the three backends side by side (their caches now warm from the processes
  above, so compiling is quick): --iters timed calls each, interleaved in rounds (one call of each
  backend per round, order rotated) so that load on this shared machine hits all three alike;
  median and p99 per backend. tpuc's output is checked against eager first.

    .venv/bin/python bench/bench_zoo.py [--models gpt2 bert ...] [--iters 200] [--out bench/results]

Writes OUT/zoo.json (raw numbers, machine), OUT/zoo.md (tables) and OUT/zoo.png (tpuc's median
latency over Inductor's and over eager's per model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_history  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
BACKENDS = ("eager", "inductor", "tpuc")


def _compiled(torch, model, backend: str, cache_dir: str):
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model)
    return torch.compile(model, backend="tpu", options={"cache_dir": cache_dir})


def child_first_call(args) -> dict:
    """First call, 20 more calls, peak RSS of one backend in this process."""
    import resource

    import torch
    import zoo

    model, inputs = zoo.make(args.model)
    with torch.no_grad():
        fn = _compiled(torch, model, args.backend, args.cache_dir)
        t0 = time.perf_counter()
        fn(*inputs)
        first = time.perf_counter() - t0
        for _ in range(20):
            fn(*inputs)
    return {"first_call_s": first, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child_steady(args) -> dict:
    """The three backends side by side, interleaved."""
    import torch
    import zoo

    model, inputs = zoo.make(args.model)
    out = {b: {} for b in BACKENDS}
    fns = {}
    with torch.no_grad():
        expected = model(*inputs)
        for b in BACKENDS:
            try:
                fns[b] = _compiled(torch, model, b, args.cache_dir)
                result = fns[b](*inputs)
                out[b]["max_abs_err"] = (result - expected).abs().max().item()
                if b == "tpuc":
                    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)
                for _ in range(5):
                    fns[b](*inputs)
            except Exception as e:  # recorded, not fatal: the row says what failed
                out[b]["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                fns.pop(b, None)
        samples = {b: [] for b in fns}
        order = list(fns)
        for i in range(args.iters):
            k = i % len(order)
            for b in order[k:] + order[:k]:
                t0 = time.perf_counter()
                fns[b](*inputs)
                samples[b].append(time.perf_counter() - t0)
    for b, times in samples.items():
        times.sort()
        out[b]["median_ms"] = statistics.median(times) * 1e3
        out[b]["p99_ms"] = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)] * 1e3
    return out


def _run_child(kind: str, model: str, cache_dir: Path, inductor_dir: Path, *extra: str) -> dict:
    env = dict(os.environ)
    for k in ("TPUC_CACHE_DIR", "TPUC_LOG", "TPUC_DUMP_DIR"):
        env.pop(k, None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    cmd = [sys.executable, __file__, "--child", kind, "--model", model, "--cache-dir", str(cache_dir), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"# Model zoo: eager vs Inductor vs tpuc, {r['date']}",
        "",
        f"torch {m['torch']}, {m['cpus']} CPUs ({m['processor']}), load average {m['load_start']} at start, "
        f"{m['load_end']} at end; float32 inference, batch and inputs from tests/zoo.py; {r['iters']} timed calls "
        "per backend, interleaved. Command: `python bench/bench_zoo.py" + r["argv"] + "`.",
        "",
        "Latency (ms, steady state, side by side in one process):",
        "",
        "| model | eager median | eager p99 | inductor median | inductor p99 | tpuc median | tpuc p99 | "
        "tpuc/inductor | tpuc/eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt="{:.3f}"):
        return fmt.format(x) if isinstance(x, int | float) else "-"

    for name, row in r["models"].items():
        s = row["steady"]
        e, i, t = (s.get(b, {}) for b in BACKENDS)
        lines.append(
            f"| {name} | {f(e.get('median_ms'))} | {f(e.get('p99_ms'))} | {f(i.get('median_ms'))} | "
            f"{f(i.get('p99_ms'))} | {f(t.get('median_ms'))} | {f(t.get('p99_ms'))} | "
            f"{f(row.get('tpuc_over_inductor'), '{:.2f}x')} | {f(row.get('tpuc_over_eager'), '{:.2f}x')} |"
        )
    g = r["geomean"]
    lines += [
        f"| **geometric mean** | | | | | | | **{f(g['tpuc_over_inductor'], '{:.2f}x')}** | "
        f"**{f(g['tpuc_over_eager'], '{:.2f}x')}** |",
        "",
        "First call (s; new process, empty caches) and peak RSS (MB) of a process that makes the first call "
        "and 20 more:",
        "",
        "| model | eager first | inductor first | tpuc first | tpuc/inductor first | eager RSS | inductor RSS | "
        "tpuc RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in r["models"].items():
        fc = row["first"]
        e, i, t = (fc.get(b, {}) for b in BACKENDS)
        ratio = (
            t["first_call_s"] / i["first_call_s"] if t.get("first_call_s") and i.get("first_call_s") else None
        )
        lines.append(
            f"| {name} | {f(e.get('first_call_s'))} | {f(i.get('first_call_s'), '{:.2f}')} | "
            f"{f(t.get('first_call_s'), '{:.2f}')} | {f(ratio, '{:.2f}x')} | {f(e.get('peak_rss_mb'), '{:.0f}')} | "
            f"{f(i.get('peak_rss_mb'), '{:.0f}')} | {f(t.get('peak_rss_mb'), '{:.0f}')} |"
        )
    errors = [
        f"- {name} {b}: {part[b]['error']}"
        for name, row in r["models"].items()
        for part in (row["first"], row["steady"])
        for b in BACKENDS
        if part.get(b, {}).get("error")
    ]
    if errors:
        lines += ["", "Failures:", "", *errors]
    lines += ["", "Plot: `zoo.png` (tpuc's median latency over Inductor's and over eager's, per model).", ""]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        n for n, row in r["models"].items() if row.get("tpuc_over_inductor") or row.get("tpuc_over_eager")
    ]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(names) + 2), 4.5))
    xs = range(len(names))
    w = 0.4
    ax.bar(
        [x - w / 2 for x in xs],
        [r["models"][n].get("tpuc_over_inductor") or 0 for n in names],
        w,
        label="tpuc / Inductor",
    )
    ax.bar(
        [x + w / 2 for x in xs],
        [r["models"][n].get("tpuc_over_eager") or 0 for n in names],
        w,
        label="tpuc / eager",
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), names, rotation=60, ha="right")
    ax.set_ylabel("median latency ratio (below 1: tpuc faster)")
    ax.set_title(f"tpuc steady-state latency, {r['date'][:10]} ({r['machine']['cpus']} CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import zoo

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(zoo.NAMES), choices=list(zoo.NAMES))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument(
        "--render", action="store_true", help="only rewrite OUT/zoo.md and zoo.png from OUT/zoo.json"
    )
    p.add_argument("--child", choices=["first-call", "steady"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        fn = child_first_call if args.child == "first-call" else child_steady
        print(json.dumps(fn(args)), flush=True)
        return 0
    if args.render:
        r = json.loads((args.out / "zoo.json").read_text())
    else:
        import torch

        r = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "argv": "".join(" " + a for a in (argv if argv is not None else sys.argv[1:])),
            "iters": args.iters,
            "machine": {
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "processor": platform.processor() or platform.machine(),
                "load_start": round(os.getloadavg()[0], 2),
            },
            "models": {},
        }
        with tempfile.TemporaryDirectory(prefix="tpuc-bench-zoo-") as tmp:
            for name in args.models:
                cache, inductor = Path(tmp) / f"{name}-tpuc", Path(tmp) / f"{name}-inductor"
                first = {b: _run_child("first-call", name, cache, inductor, "--backend", b) for b in BACKENDS}
                steady = _run_child("steady", name, cache, inductor, "--iters", str(args.iters))
                row = {"first": first, "steady": steady}
                med = {b: steady.get(b, {}).get("median_ms") for b in BACKENDS}
                if med["tpuc"] and med["inductor"]:
                    row["tpuc_over_inductor"] = med["tpuc"] / med["inductor"]
                if med["tpuc"] and med["eager"]:
                    row["tpuc_over_eager"] = med["tpuc"] / med["eager"]
                r["models"][name] = row
                print(
                    f"{name}: first call tpuc {first['tpuc'].get('first_call_s')}, inductor "
                    f"{first['inductor'].get('first_call_s')}; median ms {med}",
                    flush=True,
                )
        r["machine"]["load_end"] = round(os.getloadavg()[0], 2)
    rows = r["models"].values()
    r["geomean"] = {
        "tpuc_over_inductor": _geomean([row.get("tpuc_over_inductor") for row in rows]),
        "tpuc_over_eager": _geomean([row.get("tpuc_over_eager") for row in rows]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zoo.json").write_text(json.dumps(r, indent=1) + "\n")
    results_history.write_markdown(args.out / "zoo.md", _markdown(r))
    _plot(r, args.out / "zoo.png")
    print(_markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
