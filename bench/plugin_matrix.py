"""The model zoo (tests/zoo.py) in inference on every installed CPU PJRT plugin from PyPI:

* `xla-cpu-pjrt` (`xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so`, tpuc's default),
* `lammps-jax-pjrt-cpu` (`lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so`),
* `fastatomstruct-xla-cpu` (`fastatomstruct_xla_cpu/libpjrt_cpu.so`).

One process per plugin (a process loads a plugin for good), each with a fresh, empty tpuc cache.
Per model: `torch.compile(model, backend="tpu", dynamic=False, options={"plugin": path,
"fallback": "error"})` under `torch.no_grad()`, checked against eager with tests/test_zoo.py's
tolerances (rtol=atol=1e-5) and its conditions (no fallback ops, one graph); then --iters timed
calls of eager and of the compiled model, interleaved (one of each per round, order alternating)
so that load on a shared machine hits both alike; median of each, same process. A worker that
dies (a plugin crash) is restarted after the model it died on, which is recorded as crashed.

    .venv/bin/python bench/plugin_matrix.py [--models gpt2 bert ...] [--iters 40] [--torch-threads N]
                                            [--plugins xla-cpu-pjrt ...] [--out bench/results]

Writes OUT/plugins.json (raw numbers) and OUT/plugins.md (tables). Plugin attributes (StableHLO
versions) come from tpuc's runtime (`Runtime.stablehlo_versions`, PJRT_Plugin_Attributes).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
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

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# (distribution, file inside it): the CPU plugins this bench knows.
PLUGINS = [
    ("xla-cpu-pjrt", "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"),
    ("lammps-jax-pjrt-cpu", "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"),
    ("fastatomstruct-xla-cpu", "fastatomstruct_xla_cpu/libpjrt_cpu.so"),
]

# tests/test_zoo.py's tolerances.
TOL = dict(rtol=1e-5, atol=1e-5)


def installed() -> list[dict]:
    out = []
    for dist, rel in PLUGINS:
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        path = Path(d.locate_file(rel)).resolve()
        if path.is_file():
            out.append(
                {"wheel": dist, "version": d.version, "path": str(path), "size_bytes": path.stat().st_size}
            )
    return out


# ---------------------------------------------------------------- worker (one plugin, one process)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


def worker(args) -> None:
    import torch

    sys.path.insert(0, str(TESTS))
    import zoo

    import tpuc
    from tpuc import runtime

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    path = args.plugin
    out = open(args.results, "a", buffering=1)

    def emit(rec):
        out.write(json.dumps(rec) + "\n")

    info = {"kind": "runtime"}
    try:
        rt = runtime.get_runtime(path)
        info.update(
            platform=rt.platform,
            platform_version=rt.platform_version,
            api_version=list(rt.api_version),
            family=runtime.plugin_family(Path(path), path),
            create_options=runtime.create_options(
                runtime.plugin_family(Path(path), path), runtime.cpu_device_count()
            ),
        )
    except Exception as e:
        info["error"] = _first_line(e)
    emit(info)

    for name in args.models:
        emit({"kind": "start", "model": name})
        rec = {"kind": "model", "model": name}
        try:
            torch._dynamo.reset()
            tpuc.reset_stats()
            model, inputs = zoo.make(name)
            with torch.no_grad():
                expected = model(*inputs)
                compiled = torch.compile(
                    model,
                    backend="tpu",
                    dynamic=False,
                    options={"plugin": path, "fallback": "error", "cache_dir": args.cache_dir},
                )
                t0 = time.perf_counter()
                actual = compiled(*inputs)
                rec["first_call_s"] = time.perf_counter() - t0
                if not isinstance(actual, torch.Tensor):
                    raise AssertionError(f"compiled model returned {type(actual).__name__}")
                rec["max_abs_err"] = (actual - expected).abs().max().item()
                torch.testing.assert_close(actual, expected, **TOL)
                s = tpuc.stats()
                if s["fallback_ops"]:
                    raise AssertionError(f"fallback ops {s['fallback_ops']}")
                if s["graphs_compiled"] != 1:
                    raise AssertionError(f"{s['graphs_compiled']} graphs compiled (graph breaks)")
                # Which plugin the compiled graph ran on: the process holds one runtime per plugin.
                rec["runtimes"] = sorted({k[0] for k in runtime._runtimes})
                if rec["runtimes"] != [path]:
                    raise AssertionError(f"ran on {rec['runtimes']}, not {path}")
                rec["passed"] = True
                for _ in range(3):
                    model(*inputs)
                    compiled(*inputs)
                samples = {"eager": [], "tpuc": []}
                for i in range(args.iters):
                    order = (("eager", model), ("tpuc", compiled))
                    for label, fn in order if i % 2 == 0 else order[::-1]:
                        t0 = time.perf_counter()
                        fn(*inputs)
                        samples[label].append(time.perf_counter() - t0)
                rec["eager_median_ms"] = statistics.median(samples["eager"]) * 1e3
                rec["tpuc_median_ms"] = statistics.median(samples["tpuc"]) * 1e3
                rec["eager_min_ms"] = min(samples["eager"]) * 1e3
                rec["tpuc_min_ms"] = min(samples["tpuc"]) * 1e3
        except Exception as e:
            rec["passed"] = False
            rec["error"] = _first_line(e)
        emit(rec)
    emit({"kind": "done"})


# ---------------------------------------------------------------- driver


def run_plugin(plugin: dict, models: list[str], iters: int, timeout: float, torch_threads=None) -> dict:
    # The StableHLO versions the plugin reports (PJRT_Plugin_Attributes), read by tpuc's runtime.
    read_versions = (
        "import json, sys; from tpuc import runtime; rt = runtime.get_runtime(sys.argv[1]); "
        "cur, low = rt.stablehlo_versions or ([], []); "
        "print(json.dumps({'stablehlo_current_version': cur, 'stablehlo_minimum_version': low}))"
    )
    attrs = subprocess.run(
        [sys.executable, "-c", read_versions, plugin["path"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        plugin["attributes"] = json.loads(attrs.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        plugin["attributes"] = {"error": (attrs.stderr.strip().splitlines() or ["?"])[-1]}

    results: dict[str, dict] = {}
    runtime_info: dict = {}
    todo = list(models)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpuc-plugin-matrix-") as tmp:
        log = Path(tmp) / "results.jsonl"
        while todo:
            env = dict(os.environ, TPUC_CACHE_DIR=str(Path(tmp) / "cache"))
            env.pop("TPUC_PJRT_PLUGIN", None)
            cmd = [sys.executable, __file__, "--worker", "--plugin", plugin["path"], "--results", str(log)]
            cmd += ["--cache-dir", str(Path(tmp) / "cache"), "--iters", str(iters), "--models", *todo]
            if torch_threads:
                cmd += ["--torch-threads", str(torch_threads)]
            left = timeout - (time.perf_counter() - t_start)
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(left, 1))
                rc, stderr = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as e:
                err = e.stderr or b""
                rc, stderr = "timeout", err.decode(errors="replace") if isinstance(err, bytes) else err
            started = None
            for line in log.read_text().splitlines() if log.exists() else []:
                rec = json.loads(line)
                if rec["kind"] == "runtime":
                    runtime_info = rec
                elif rec["kind"] == "start":
                    started = rec["model"]
                elif rec["kind"] == "model":
                    results[rec["model"]] = rec
                    started = None
            todo = [m for m in models if m not in results]
            if not todo:
                break
            # The worker died (or timed out) in `started`: record it and go on after it.
            victim = started or todo[0]
            tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
            results[victim] = {
                "model": victim,
                "passed": False,
                "error": f"worker exited ({rc}) during this model: " + " | ".join(tail)[:400],
            }
            todo = [m for m in models if m not in results]
            if rc == "timeout":
                for m in todo:
                    results[m] = {"model": m, "passed": False, "error": "not run (plugin time limit)"}
                break
    plugin["runtime"] = runtime_info
    plugin["results"] = [results[m] for m in models]
    plugin["wall_s"] = time.perf_counter() - t_start
    return plugin


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _latency_rows(plugins: list[dict], names: list[str], stat: str) -> list[str]:
    """One table row per model: `tpuc / eager (ratio)` ms of statistic `stat` per plugin."""
    rows = []
    for i, name in enumerate(names):
        cells = []
        for p in plugins:
            r = p["results"][i]
            tpuc, eager = r.get(f"tpuc_{stat}_ms"), r.get(f"eager_{stat}_ms")
            if tpuc:
                cells.append(f"{tpuc:.2f} / {eager:.2f} ({tpuc / eager:.2f})")
            else:
                cells.append("FAIL" if not r.get("passed") else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def markdown(report: dict) -> str:
    plugins = report["plugins"]
    lines = [
        "# tpuc on the CPU PJRT plugins from PyPI",
        "",
        f"{report['date']}, {report['machine']}, torch {report['torch']} (torch threads: {report['torch_threads']}); "
        f"written by "
        f"`bench/plugin_matrix.py` ({report['iters']} interleaved timed calls per model and side, "
        f"median). Correctness: tests/test_zoo.py's checks (rtol=atol=1e-5 vs eager, no fallback "
        f'ops, one graph), `fallback="error"`, inference under `torch.no_grad()`.',
        "",
        "| plugin (wheel) | version | .so | size | PJRT API | platform version | StableHLO current / min | "
        "models passing | geomean tpuc/eager (median) | (min) | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plugins:
        a = p.get("attributes") or {}
        cur = ".".join(map(str, a.get("stablehlo_current_version", []))) or "?"
        mn = ".".join(map(str, a.get("stablehlo_minimum_version", []))) or "?"
        rt = p.get("runtime") or {}
        api = ".".join(map(str, rt.get("api_version", []))) or rt.get("error", "?")
        ok = sum(r.get("passed", False) for r in p["results"])
        ratios = [r["tpuc_median_ms"] / r["eager_median_ms"] for r in p["results"] if r.get("tpuc_median_ms")]
        g = _geomean(ratios)
        gmin = _geomean([r["tpuc_min_ms"] / r["eager_min_ms"] for r in p["results"] if r.get("tpuc_min_ms")])
        lines.append(
            f"| {p['wheel']} | {p['version']} | `{Path(p['path']).name}` | {p['size_bytes'] / 1e6:.0f} MB | "
            f"{api} | {rt.get('platform_version', '?')} | {cur} / {mn} | {ok} / {len(p['results'])} | "
            f"{f'{g:.2f}' if g else '-'} | {f'{gmin:.2f}' if gmin else '-'} | {p['wall_s']:.0f} s |"
        )
    failures = [(p["wheel"], r) for p in plugins for r in p["results"] if not r.get("passed")]
    lines += ["", "## Failures", ""]
    if failures:
        lines += ["| plugin | model | reason |", "|---|---|---|"]
        for wheel, r in failures:
            reason = r.get("error", "?").replace("|", "\\|")
            lines.append(f"| {wheel} | {r['model']} | {reason} |")
    else:
        lines.append("None: every model passes on every plugin.")
    lines += [
        "",
        "## Median inference latency (ms), compiled vs eager in the same process",
        "",
        "Each cell: tpuc ms / eager ms (ratio; below 1: tpuc faster). This machine's 2 cores are shared "
        "with other work: eager's two OpenMP threads suffer most when a core is taken (a straggler "
        "stalls each op), so ratios vary between runs; plugins.json also has each side's minimum.",
        "",
        "| model | " + " | ".join(p["wheel"] for p in plugins) + " |",
        "|---|" + "---|" * len(plugins),
    ]
    names = [r["model"] for r in plugins[0]["results"]] if plugins else []
    lines += _latency_rows(plugins, names, "median")
    lines += [
        "",
        "Minimum latency (ms) of the same calls, tpuc / eager (ratio): less sensitive to other load.",
        "",
        "| model | " + " | ".join(p["wheel"] for p in plugins) + " |",
        "|---|" + "---|" * len(plugins),
    ]
    lines += _latency_rows(plugins, names, "min")
    lines += [
        "",
        "First call (Dynamo + AOTAutograd + lowering + the plugin's XLA compile + one run), seconds:",
        "",
        "| model | " + " | ".join(p["wheel"] for p in plugins) + " |",
        "|---|" + "---|" * len(plugins),
    ]
    for i, name in enumerate(names):
        cells = [
            f"{p['results'][i]['first_call_s']:.2f}" if p["results"][i].get("first_call_s") else "-"
            for p in plugins
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Load average at start / end: {report['loadavg_start']} / {report['loadavg_end']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+")
    ap.add_argument("--plugins", nargs="+", help="wheel names (default: every installed one)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per plugin")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads in the workers (eager)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plugin", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, str(TESTS))
    import torch
    import zoo

    models = args.models or zoo.NAMES
    plugins = [p for p in installed() if not args.plugins or p["wheel"] in args.plugins]
    if not plugins:
        print("no CPU PJRT plugin installed (pip install --no-deps xla-cpu-pjrt ...)", file=sys.stderr)
        return 1
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "iters": args.iters,
        "torch_threads": args.torch_threads or torch.get_num_threads(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "plugins": [],
    }
    for p in plugins:
        print(f"== {p['wheel']} {p['version']}: {p['path']}", flush=True)
        run_plugin(p, models, args.iters, args.timeout, args.torch_threads)
        ok = sum(r.get("passed", False) for r in p["results"])
        print(f"   {ok}/{len(models)} passed in {p['wall_s']:.0f} s", flush=True)
        for r in p["results"]:
            if not r.get("passed"):
                print(f"   FAIL {r['model']}: {r.get('error')}", flush=True)
        report["plugins"].append(p)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plugins.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "plugins.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
