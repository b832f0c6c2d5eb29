"""Benchmark tpuc against eager PyTorch and Inductor on the four reference models.

For each model of tests/models.py (float32, inference), in one process:

* first call: `torch._dynamo.reset()`, then the wall time of the first call of the compiled
  model, which includes Dynamo tracing, AOTAutograd, the backend's compile and one run. Both
  compilers start cold: Inductor and tpuc get fresh, empty on-disk caches for this run
  (unless --keep-caches). The first model also pays each backend's one-time per-process setup.
* steady state: warmup calls, then --iters timed calls per backend, interleaved in rounds
  (one call of each backend per round, order rotated) so that noise on a shared machine hits
  all three alike; the median is reported.

tpuc's output is checked against eager (rtol=atol=1e-5) before timing. An Inductor failure
(for instance no C++ compiler) is recorded in the results instead of stopping the run.

    .venv/bin/python bench/bench_models.py [--models mlp preln] [--iters 200] [--warmup 20]
                                           [--batch 8 | --batch mlp=16 --batch preln=2] [--out DIR]

Writes DIR/latest.json (raw numbers and machine info) and DIR/latest.md (the table below).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import results_history  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_BATCH = {"mlp": 8, "preln": 4, "postln": 4, "convnet": 8}  # the order of models.NAMES
BACKENDS = ("eager", "inductor", "tpuc")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_BATCH), choices=list(DEFAULT_BATCH))
    p.add_argument("--iters", type=int, default=500, help="timed calls per backend (default 500)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per backend first (default 20)")
    p.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="N|MODEL=N",
        help="batch size for every model (N) or one model (MODEL=N); repeatable",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for eager and Inductor (default: torch's)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument(
        "--keep-caches",
        action="store_true",
        help="use the usual on-disk compile caches instead of fresh empty ones (warm first calls)",
    )
    args = p.parse_args(argv)
    batch = dict(DEFAULT_BATCH)
    for item in args.batch:
        name, sep, value = item.rpartition("=")
        if sep and name not in batch:
            p.error(f"--batch {item}: unknown model {name!r}")
        try:
            n = int(value)
        except ValueError:
            p.error(f"--batch {item}: not an integer")
        for key in [name] if sep else batch:
            batch[key] = n
    args.batch = batch
    return args


def error_text(e: BaseException) -> str:
    lines = f"{type(e).__name__}: {e}".strip().splitlines()
    return " ".join(lines)[:500]


def first_call(torch, model, inputs, **compile_kwargs):
    """Resets Dynamo, compiles `model` and times its first call. Returns (compiled, output, seconds)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, **compile_kwargs)
    t0 = time.perf_counter()
    out = compiled(*inputs)
    return compiled, out, time.perf_counter() - t0


def bench_model(torch, models, name, batch, args) -> dict:
    model, inputs = models.make(name, torch.float32, batch=batch)
    row = {"model": name, "batch": batch, "input_shapes": [list(x.shape) for x in inputs]}
    fns = {"eager": model}
    res = {b: {"first_call_s": None, "median_ms": None, "error": None} for b in BACKENDS}
    row["backends"] = res

    with torch.no_grad():
        expected = model(*inputs)

        # tpuc first: its later re-trace (after the reset below) is the cheaper one.
        try:
            fns["tpuc"], out, res["tpuc"]["first_call_s"] = first_call(torch, model, inputs, backend="tpu")
            res["tpuc"]["max_abs_err"] = (out - expected).abs().max().item()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        except Exception as e:
            res["tpuc"]["error"] = error_text(e)
            if not isinstance(e, AssertionError):
                traceback.print_exc()
                fns.pop("tpuc", None)

        try:
            fns["inductor"], out, res["inductor"]["first_call_s"] = first_call(torch, model, inputs)
            res["inductor"]["max_abs_err"] = (out - expected).abs().max().item()
        except Exception as e:
            res["inductor"]["error"] = error_text(e)
            traceback.print_exc()
            fns.pop("inductor", None)

        # The reset before Inductor's first call dropped tpuc's Dynamo cache entry: the first
        # warmup call re-traces it. Warmup is not timed.
        for b, fn in list(fns.items()):
            try:
                for _ in range(args.warmup):
                    fn(*inputs)
            except Exception as e:
                res[b]["error"] = error_text(e)
                traceback.print_exc()
                del fns[b]

        samples = {b: [] for b in fns}
        order = list(fns)
        for i in range(args.iters):
            k = i % len(order)
            for b in order[k:] + order[:k]:
                fn = fns[b]
                t0 = time.perf_counter()
                fn(*inputs)
                samples[b].append(time.perf_counter() - t0)

    for b, s in samples.items():
        ms = sorted(x * 1e3 for x in s)
        res[b].update(
            median_ms=statistics.median(ms),
            min_ms=ms[0],
            p90_ms=ms[int(0.9 * (len(ms) - 1))],
            samples_ms=[round(x * 1e3, 5) for x in s],
        )

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    row["ratios"] = {
        "steady_tpuc_over_eager": ratio(res["tpuc"]["median_ms"], res["eager"]["median_ms"]),
        "steady_tpuc_over_inductor": ratio(res["tpuc"]["median_ms"], res["inductor"]["median_ms"]),
        "first_call_tpuc_over_inductor": ratio(res["tpuc"]["first_call_s"], res["inductor"]["first_call_s"]),
        "min_tpuc_over_eager": ratio(res["tpuc"].get("min_ms"), res["eager"].get("min_ms")),
        "min_tpuc_over_inductor": ratio(res["tpuc"].get("min_ms"), res["inductor"].get("min_ms")),
    }
    return row


def fmt(value, spec, suffix=""):
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown(rows, info) -> str:
    lines = [
        f"tpuc benchmark, {info['date']}: torch {info['torch']}, {info['cpu_count']} CPUs "
        f"({info['cpu_model']}), {info['torch_threads']} torch threads, load average {info['loadavg_at_start'][0]} "
        f"at start; float32 inference; "
        f"{info['iters']} timed calls per backend (median), first call = trace + compile + one run"
        f"{' (cold caches)' if info['cold_caches'] else ' (warm caches)'}.",
        "",
        "| model | batch | eager ms | inductor ms | tpuc ms | tpuc/eager | tpuc/inductor "
        "| inductor first call s | tpuc first call s | first call tpuc/inductor | tpuc max abs err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, q = r["backends"], r["ratios"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {fmt(b['eager']['median_ms'], '.3f')} "
            f"| {fmt(b['inductor']['median_ms'], '.3f')} | {fmt(b['tpuc']['median_ms'], '.3f')} "
            f"| {fmt(q['steady_tpuc_over_eager'], '.2f', 'x')} | {fmt(q['steady_tpuc_over_inductor'], '.2f', 'x')} "
            f"| {fmt(b['inductor']['first_call_s'], '.2f')} | {fmt(b['tpuc']['first_call_s'], '.2f')} "
            f"| {fmt(q['first_call_tpuc_over_inductor'], '.3f', 'x')} | {fmt(b['tpuc'].get('max_abs_err'), '.1e')} |"
        )
    lines += [
        "",
        "Fastest single call (least disturbed by other load on the machine):",
        "",
        "| model | eager min ms | inductor min ms | tpuc min ms | tpuc/eager | tpuc/inductor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, q = r["backends"], r["ratios"]
        lines.append(
            f"| {r['model']} | {fmt(b['eager'].get('min_ms'), '.3f')} | {fmt(b['inductor'].get('min_ms'), '.3f')} "
            f"| {fmt(b['tpuc'].get('min_ms'), '.3f')} | {fmt(q['min_tpuc_over_eager'], '.2f', 'x')} "
            f"| {fmt(q['min_tpuc_over_inductor'], '.2f', 'x')} |"
        )
    errors = [(r["model"], k, v["error"]) for r in rows for k, v in r["backends"].items() if v["error"]]
    if errors:
        lines += ["", "Failures:", ""]
        lines += [f"- {m} / {k}: {e}" for m, k, e in errors]
    lines += ["", "Ratios below 1 mean tpuc is faster."]
    load = max(info["loadavg_at_start"][0], info["loadavg_at_end"][0])
    if load > 0.5 * info["cpu_count"]:
        lines += [
            "",
            f"Note: the machine was busy (load average up to {load} on {info['cpu_count']} CPUs). Eager and "
            f"Inductor run OpenMP with {info['torch_threads']} threads and slow down sharply when another "
            "process takes a CPU, so their medians are noisy here; the fastest-call table is steadier "
            "(or rerun with --threads 1).",
        ]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    tmp = None
    if not args.keep_caches:
        # Fresh, empty compile caches so that both compilers' first calls are cold every run.
        tmp = tempfile.TemporaryDirectory(prefix="tpuc-bench-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp.name, "inductor")
        os.environ["TPUC_CACHE_DIR"] = os.path.join(tmp.name, "tpuc")

    import models  # tests/models.py
    import torch

    import tpuc

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    # Warm Dynamo itself up once, so the first model's first calls measure the backends.
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
    torch._dynamo.reset()
    tpuc.reset_stats()

    rows = []
    for name in args.models:
        print(f"== {name} (batch {args.batch[name]})", flush=True)
        rows.append(bench_model(torch, models, name, args.batch[name], args))

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "tpuc": tpuc.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": load_at_start,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "dtype": "float32",
        "iters": args.iters,
        "warmup": args.warmup,
        "cold_caches": not args.keep_caches,
        "total_seconds": round(time.perf_counter() - start, 2),
    }
    stats = tpuc.stats()
    table = markdown(rows, info)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(
        json.dumps({"info": info, "tpuc_stats": stats, "results": rows}, indent=1)
    )
    results_history.write_markdown(args.out / "latest.md", table)
    print()
    print(table)
    print(f"written: {args.out / 'latest.json'}, {args.out / 'latest.md'} ({info['total_seconds']:.0f} s)")
    if tmp is not None:
        tmp.cleanup()

    tpuc_failed = any(r["backends"]["tpuc"]["error"] for r in rows)
    return 1 if tpuc_failed else 0


if __name__ == "__main__":
    sys.exit(main())
