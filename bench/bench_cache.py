"""Measures what the persistent executable cache buys (issue 4, "Done when").

(a) First call, cold vs warm: a new process compiles a model into an empty cache folder (cold),
    then another new process compiles the same model with the same folder (warm). The time of
    the first call of the compiled model (Dynamo + AOTAutograd tracing, tpuc lowering, PJRT
    compile or cache load, one run) is compared, and broken down: Dynamo (bytecode trace and
    guards), AOTAutograd (functionalization, decompositions), tpuc's FX export and import,
    tpuc's lowering (specialize + StableHLO) and tpuc's compile (PJRT compile when cold, disk
    read + verify + deserialize when warm), the run itself.
(b) Precompile of 8 shape buckets, in parallel (TPUC_COMPILE_PROCESSES=<CPUs> worker processes) vs
    serially (TPUC_COMPILE_PROCESSES=1 RAYON_NUM_THREADS=1), each in a new process with a fresh
    cache folder. The whole `tpuc.precompile` call is timed, and its compiling part separately.
(c) A saved compiled model (`tpuc.save_compiled`): saved in one process with an empty cache, then
    loaded (`tpuc.load_compiled`) and called once in a new process with the same cache: neither
    Dynamo nor AOTAutograd trace, nothing compiles. Compared with (a)'s cold first call.

Every measurement is a new process; --reps repetitions, medians reported (min too).

    .venv/bin/python bench/bench_cache.py [--models zoo:gpt2 zoo:resnet18] [--reps 3]
                                          [--precompile-model preln] [--out bench/results]

Model names: `zoo:NAME` (tests/zoo.py) or `NAME` (tests/models.py). Writes OUT/cache.json (raw
numbers, machine info) and OUT/cache.md (tables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
BUCKETS = [2, 4, 6, 8, 10, 12, 14, 16]  # with max 16: 8 buckets


# ---------------------------------------------------------------------------------------------
# Child processes


def _load_model(spec: str, batch: int | None = None):
    sys.path.insert(0, str(TESTS))
    if spec.startswith("zoo:"):
        import zoo

        return zoo.make(spec.removeprefix("zoo:"))
    import models

    return models.make(spec, batch=batch or 2)


class _Timers:
    """Wraps backend internals to time the parts of a first call."""

    def __init__(self):
        from tpuc import backend, compiled_graph

        self.backend_seconds = 0.0  # tpu_backend: AOTAutograd + tpuc (everything after Dynamo)
        self.graph_seconds = 0.0  # CompiledGraph construction: FX export/import + static compile
        self.executables = []
        from tpuc import runtime

        self.runtime_seconds = 0.0  # loading the plugin and creating the PJRT client (once)
        inner_compile, inner_init = backend._compile, compiled_graph.CompiledGraph.__init__
        inner_record, inner_runtime = compiled_graph.record_compile, runtime.get_runtime

        def timed_runtime(*a, **k):
            t = time.perf_counter()
            try:
                return inner_runtime(*a, **k)
            finally:
                self.runtime_seconds += time.perf_counter() - t

        def timed_compile(*a, **k):
            t = time.perf_counter()
            try:
                return inner_compile(*a, **k)
            finally:
                self.backend_seconds += time.perf_counter() - t

        def timed_init(cg, *a, **k):
            t = time.perf_counter()
            try:
                return inner_init(cg, *a, **k)
            finally:
                self.graph_seconds += time.perf_counter() - t

        def record(exe):
            self.executables.append(
                {
                    "key": exe.key,
                    "cache": exe.cache,
                    "lower_seconds": exe.lower_seconds,
                    "compile_seconds": exe.compile_seconds,
                }
            )
            inner_record(exe)

        backend._compile = timed_compile
        compiled_graph.CompiledGraph.__init__ = timed_init
        compiled_graph.record_compile = record
        runtime.get_runtime = timed_runtime


def child_first_call(args) -> dict:
    t_start = time.perf_counter()
    import torch

    import tpuc

    t_imported = time.perf_counter()
    timers = _Timers()
    torch.set_num_threads(1)
    model, inputs = _load_model(args.model)
    compiled = torch.compile(
        model, backend="tpu", dynamic=False, options={"cache_dir": args.cache_dir, "fallback": "error"}
    )
    tpuc.reset_stats()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = compiled(*inputs)
        first = time.perf_counter() - t0
        runs = []
        for _ in range(5):
            t1 = time.perf_counter()
            compiled(*inputs)
            runs.append(time.perf_counter() - t1)
        expected = model(*inputs)
    err = (out - expected).abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    lower = sum(e["lower_seconds"] for e in timers.executables)
    compile_or_load = sum(e["compile_seconds"] for e in timers.executables)
    run = statistics.median(runs)
    return {
        "import_seconds": t_imported - t_start,
        "first_call_seconds": first,
        "breakdown": {
            "dynamo": first - timers.backend_seconds - run,
            "aot_autograd": timers.backend_seconds - timers.graph_seconds - timers.runtime_seconds,
            "pjrt_client_setup": timers.runtime_seconds,
            "tpuc_fx_export_import": timers.graph_seconds - lower - compile_or_load,
            "tpuc_lower": lower,
            "tpuc_compile_or_load": compile_or_load,
            "run": run,
        },
        "executables": timers.executables,
        "stats": tpuc.stats(),
        "max_abs_err": err,
    }


def child_saved(args) -> dict:
    """`tpuc.save_compiled` (action save: an empty cache, so it compiles) or `tpuc.load_compiled`
    (action load: a new process, the same cache) of the model, then its first call. The load is
    timed from before `tpuc.load_compiled` is looked up (importing tpuc.saved, which imports
    torch._inductor's OutputCode, is part of it) to the end of the first call."""
    t_start = time.perf_counter()
    import torch

    import tpuc
    from tpuc import backend  # noqa: F401  (imported before the timer, as in child_first_call)

    t_imported = time.perf_counter()
    torch.set_num_threads(1)
    model, inputs = _load_model(args.model)
    options = {"cache_dir": args.cache_dir, "fallback": "error"}
    path = Path(args.cache_dir) / "model.tpuc"
    with torch.no_grad():
        t0 = time.perf_counter()
        if args.action == "save":
            fn = tpuc.save_compiled(model, path, inputs, options=options)
        else:
            fn = tpuc.load_compiled(path, model, options=options)
        t1 = time.perf_counter()
        out = fn(*inputs)
        t2 = time.perf_counter()
        expected = model(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    return {
        "import_seconds": t_imported - t_start,
        "save_or_load_seconds": t1 - t0,
        "first_call_seconds": t2 - t0,
        "stats": tpuc.stats(),
        "file_bytes": path.stat().st_size,
        "max_abs_err": (out - expected).abs().max().item(),
    }


def child_precompile(args) -> dict:
    import resource

    import torch

    import tpuc

    torch.set_num_threads(1)
    model, (x,) = _load_model(args.model, batch=3)  # not a bucket: all 8 are compiled

    def cpu() -> float:  # this process and its finished children (compile workers)
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0 = cpu()
    report = tpuc.precompile(
        model,
        (x,),
        dynamic={0: {0: max(BUCKETS)}},
        buckets=BUCKETS,
        options={"cache_dir": args.cache_dir, "fallback": "error"},
    )
    report["cpu_seconds"] = cpu() - c0
    report["compile_processes_env"] = os.environ.get("TPUC_COMPILE_PROCESSES", "default")
    report["stats"] = tpuc.stats()
    return report


# ---------------------------------------------------------------------------------------------
# Driver


def _child(kind: str, model: str, cache_dir: Path, *extra: str, **env: str) -> dict:
    e = dict(os.environ)
    for k in ("TPUC_CACHE_DIR", "TPUC_CACHE_MAX_SIZE", "TPUC_LOG", "TPUC_DUMP_DIR", "RAYON_NUM_THREADS"):
        e.pop(k, None)
    e.update(env)
    cmd = [sys.executable, __file__, "--child", kind, "--model", model, "--cache-dir", str(cache_dir), *extra]
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result["load_average_at_start"] = load
    return result


def _med(xs):
    return statistics.median(xs)


def measure_first_calls(models: list[str], reps: int, tmp: Path) -> dict:
    out = {}
    for m in models:
        cold, warm = [], []
        for r in range(reps):
            d = tmp / f"{m.replace(':', '_')}-{r}"
            c = _child("first-call", m, d)
            w = _child("first-call", m, d)
            assert c["stats"]["xla_compiles"] > 0 and c["stats"]["cache_hits_disk"] == 0, c["stats"]
            assert w["stats"]["xla_compiles"] == 0 and w["stats"]["cache_hits_disk"] > 0, w["stats"]
            cold.append(c)
            warm.append(w)
            print(
                f"{m} rep {r}: cold {c['first_call_seconds']:.2f}s, warm {w['first_call_seconds']:.2f}s",
                flush=True,
            )
        summary = {}
        for name, runs in (("cold", cold), ("warm", warm)):
            summary[name] = {
                "first_call_seconds": _med([x["first_call_seconds"] for x in runs]),
                "first_call_min_seconds": min(x["first_call_seconds"] for x in runs),
                "breakdown": {k: _med([x["breakdown"][k] for x in runs]) for k in runs[0]["breakdown"]},
                "import_seconds": _med([x["import_seconds"] for x in runs]),
            }
        summary["ratio"] = summary["cold"]["first_call_seconds"] / summary["warm"]["first_call_seconds"]
        summary["ratio_tpuc_part"] = sum(
            summary["cold"]["breakdown"][k] for k in ("tpuc_lower", "tpuc_compile_or_load")
        ) / sum(summary["warm"]["breakdown"][k] for k in ("tpuc_lower", "tpuc_compile_or_load"))
        summary["runs"] = {"cold": cold, "warm": warm}
        out[m] = summary
    return out


def measure_saved(models: list[str], reps: int, tmp: Path, first_call: dict) -> dict:
    """(c): save in one process (empty cache), load + first call in new processes."""
    out = {}
    for m in models:
        saves, loads = [], []
        for r in range(reps):
            d = tmp / f"saved-{m.replace(':', '_')}-{r}"
            s = _child("saved", m, d, "--action", "save")
            ld = _child("saved", m, d, "--action", "load")
            assert s["stats"]["xla_compiles"] > 0, s["stats"]
            assert ld["stats"]["xla_compiles"] == 0 and ld["stats"]["cache_hits_disk"] > 0, ld["stats"]
            saves.append(s)
            loads.append(ld)
            print(
                f"{m} rep {r}: save+first call {s['first_call_seconds']:.2f}s, "
                f"load+first call {ld['first_call_seconds']:.2f}s",
                flush=True,
            )
        summary = {
            "save_first_call_seconds": _med([x["first_call_seconds"] for x in saves]),
            "load_first_call_seconds": _med([x["first_call_seconds"] for x in loads]),
            "load_first_call_min_seconds": min(x["first_call_seconds"] for x in loads),
            "load_seconds": _med([x["save_or_load_seconds"] for x in loads]),
            "file_bytes": saves[0]["file_bytes"],
            "runs": {"save": saves, "load": loads},
        }
        cold = first_call.get(m, {}).get("cold", {}).get("first_call_seconds")
        if cold is not None:
            summary["cold_first_call_seconds"] = cold
            summary["ratio_vs_cold"] = cold / summary["load_first_call_seconds"]
        summary["ratio_vs_save"] = summary["save_first_call_seconds"] / summary["load_first_call_seconds"]
        out[m] = summary
    return out


def measure_precompile(model: str, reps: int, tmp: Path) -> dict:
    par, ser = [], []
    for r in range(reps):
        # Alternate the order so that drifting load hits both alike.
        workers = str(os.cpu_count() or 2)
        order = [
            ("parallel", {"TPUC_COMPILE_PROCESSES": workers}),
            ("serial", {"TPUC_COMPILE_PROCESSES": "1", "RAYON_NUM_THREADS": "1"}),
        ]
        for kind, env in order if r % 2 == 0 else order[::-1]:
            rep = _child("precompile", model, tmp / f"pre-{kind}-{r}", **env)
            assert rep["executables"] == len(BUCKETS) and rep["compiled"] == len(BUCKETS), rep
            (par if kind == "parallel" else ser).append(rep)
            print(
                f"precompile {kind} rep {r}: {rep['seconds']:.2f}s total, "
                f"{rep['compile_seconds']:.2f}s compiling, {rep['processes']} process(es)",
                flush=True,
            )
    res = {}
    for kind, runs in (("parallel", par), ("serial", ser)):
        res[kind] = {
            "seconds": _med([x["seconds"] for x in runs]),
            "compile_seconds": _med([x["compile_seconds"] for x in runs]),
            "compile_min_seconds": min(x["compile_seconds"] for x in runs),
            "cpu_seconds": _med([x["cpu_seconds"] for x in runs]),
            "processes": runs[0]["processes"],
            "runs": runs,
        }
    res["speedup_total"] = res["serial"]["seconds"] / res["parallel"]["seconds"]
    res["speedup_compile"] = res["serial"]["compile_seconds"] / res["parallel"]["compile_seconds"]
    res["speedup_compile_min"] = res["serial"]["compile_min_seconds"] / res["parallel"]["compile_min_seconds"]
    return res


def _markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"# tpuc executable cache benchmark, {r['date']}",
        "",
        f"torch {m['torch']}, {m['cpus']} CPUs ({m['processor']}), load average {m['load_start']} at start, "
        f"{m['load_end']} at end; {r['reps']} repetitions, medians; every number from a new process.",
        "",
        "## (a) First call, cold cache vs warm cache (new process, same cache folder)",
        "",
        "First call = Dynamo + AOTAutograd tracing + tpuc lowering + PJRT compile (cold) or cache "
        "load (warm) + one run. Target: warm at least 5x faster than cold.",
        "",
        "| model | cold s | warm s | cold/warm | tpuc lower+compile cold s | tpuc lower+load warm s | "
        "tpuc part cold/warm |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["first_call"].items():
        c, w = s["cold"], s["warm"]
        tc = c["breakdown"]["tpuc_lower"] + c["breakdown"]["tpuc_compile_or_load"]
        tw = w["breakdown"]["tpuc_lower"] + w["breakdown"]["tpuc_compile_or_load"]
        lines.append(
            f"| {name} | {c['first_call_seconds']:.2f} | {w['first_call_seconds']:.2f} | {s['ratio']:.2f}x "
            f"| {tc:.3f} | {tw:.3f} | {s['ratio_tpuc_part']:.1f}x |"
        )
    lines += [
        "",
        "Breakdown of the first call (seconds, medians):",
        "",
        "| model | cache | Dynamo | AOTAutograd | PJRT client setup | tpuc FX export+import | tpuc lower | "
        "tpuc compile (cold) / load (warm) | run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["first_call"].items():
        for kind in ("cold", "warm"):
            b = s[kind]["breakdown"]
            lines.append(
                f"| {name} | {kind} | {b['dynamo']:.3f} | {b['aot_autograd']:.3f} | {b['pjrt_client_setup']:.3f} | "
                f"{b['tpuc_fx_export_import']:.3f} | {b['tpuc_lower']:.3f} | {b['tpuc_compile_or_load']:.3f} "
                f"| {b['run']:.4f} |"
            )
    if r.get("saved"):
        lines += [
            "",
            "## (c) First call of a saved compiled model (`tpuc.save_compiled` in one process, "
            "`tpuc.load_compiled` in a new process, same cache)",
            "",
            "Load + first call: no Dynamo trace, no AOTAutograd trace, no XLA compile (tpuc imports and "
            "lowers the saved graphs; executables from the disk cache); timed from before `tpuc.load_compiled` "
            "(including importing it) to the end of the first call. Cold = (a)'s cold first call of "
            "`torch.compile` (empty cache). Target: at least 5x faster than cold.",
            "",
            "| model | cold first call s (a) | save + first call s | load + first call s | cold / load | "
            "save / load | file bytes |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, s in r["saved"].items():
            cold = s.get("cold_first_call_seconds")
            lines.append(
                f"| {name} | {cold:.2f} | {s['save_first_call_seconds']:.2f} | {s['load_first_call_seconds']:.2f} | "
                f"{s['ratio_vs_cold']:.1f}x | {s['ratio_vs_save']:.1f}x | {s['file_bytes']:,} |"
                if cold is not None
                else f"| {name} | - | {s['save_first_call_seconds']:.2f} | {s['load_first_call_seconds']:.2f} | - | "
                f"{s['ratio_vs_save']:.1f}x | {s['file_bytes']:,} |"
            )
    p = r["precompile"]
    lines += [
        "",
        f"## (b) tpuc.precompile of {len(BUCKETS)} buckets ({r['precompile_model']}, batch dim dynamic, "
        f"buckets {BUCKETS}), parallel vs serial",
        "",
        "Parallel: one compile worker process per CPU (`TPUC_COMPILE_PROCESSES=<CPUs>`, "
        "python/tpuc/compile_workers.py); serial: `TPUC_COMPILE_PROCESSES=1 RAYON_NUM_THREADS=1` (one "
        "process, one thread); fresh cache folders. Compiling = the buckets' part of `tpuc.precompile` "
        "(workers compile into the cache, then this process loads every executable); total = the whole "
        "call (also Dynamo/AOTAutograd tracing and the example call, which compiles one bucket "
        "in-process). Target: at least 1.6x on 2 cores.",
        "",
        "| | parallel s | serial s | speedup |",
        "|---|---:|---:|---:|",
        f"| compiling (median) | {p['parallel']['compile_seconds']:.2f} | {p['serial']['compile_seconds']:.2f} | "
        f"{p['speedup_compile']:.2f}x |",
        f"| compiling (fastest run) | {p['parallel']['compile_min_seconds']:.2f} | "
        f"{p['serial']['compile_min_seconds']:.2f} | {p['speedup_compile_min']:.2f}x |",
        f"| CPU seconds, with workers (median) | {p['parallel']['cpu_seconds']:.2f} | "
        f"{p['serial']['cpu_seconds']:.2f} | |",
        f"| whole precompile (median) | {p['parallel']['seconds']:.2f} | {p['serial']['seconds']:.2f} | "
        f"{p['speedup_total']:.2f}x |",
        f"| compile processes | {p['parallel']['processes']} | {p['serial']['processes']} | |",
        "",
        f"Cores kept busy by one serial process (CPU s / whole-call wall s): "
        f"{p['serial']['cpu_seconds'] / p['serial']['seconds']:.2f}. When that is already the machine's "
        "CPU count, one XLA compile uses every core and worker processes cannot help.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["zoo:gpt2", "zoo:resnet18"])
    p.add_argument("--precompile-model", default="preln")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--skip", choices=["first-call", "saved", "precompile"], nargs="*", default=[])
    p.add_argument(
        "--child", choices=["first-call", "saved", "precompile"], default=None, help=argparse.SUPPRESS
    )
    p.add_argument("--action", choices=["save", "load"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--render", action="store_true", help="only rewrite OUT/cache.md from OUT/cache.json")
    args = p.parse_args(argv)
    if args.render:
        md = _markdown(json.loads((args.out / "cache.json").read_text()))
        (args.out / "cache.md").write_text(md)
        print(md)
        return 0
    if args.child:
        fn = {"first-call": child_first_call, "saved": child_saved, "precompile": child_precompile}[
            args.child
        ]
        print(json.dumps(fn(args)), flush=True)
        return 0

    import torch

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "reps": args.reps,
        "machine": {
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_start": round(os.getloadavg()[0], 2),
        },
        "precompile_model": args.precompile_model,
        "first_call": {},
        "saved": {},
        "precompile": None,
    }
    with tempfile.TemporaryDirectory(prefix="tpuc-bench-cache-") as tmp:
        if "first-call" not in args.skip:
            result["first_call"] = measure_first_calls(args.models, args.reps, Path(tmp))
        if "saved" not in args.skip:
            result["saved"] = measure_saved(args.models, args.reps, Path(tmp), result["first_call"])
        if "precompile" not in args.skip:
            result["precompile"] = measure_precompile(args.precompile_model, args.reps, Path(tmp))
    result["machine"]["load_end"] = round(os.getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.json").write_text(json.dumps(result, indent=2) + "\n")
    if result["first_call"] and result["precompile"]:
        (args.out / "cache.md").write_text(_markdown(result))
        print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
