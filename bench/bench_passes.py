"""IR passes on vs off (issue 7, "Done when"): for zoo models, the StableHLO tpuc hands to PJRT
(op count, counted in `exe.mlir` the way `tpuc dump` counts: module/func/return left out), the
XLA compile time and the steady-state latency, with every pass on and with every pass off
(`options={"passes": {"cleanup": False, "fusion": False}}`), side by side in one run.

Each repetition is one fresh process that compiles the model twice (a deep copy with the same
weights for the second variant, so Dynamo keeps both), checks both against eager, then times
steady-state calls interleaved in rounds (one call of each variant per round, order rotated) so
that noise on a shared machine hits both alike. The variant compiled first alternates between
repetitions. Reported: StableHLO ops (sum over the model's graphs; deterministic), IR ops after
the passes, XLA compile seconds (median over repetitions of the sum over graphs), steady-state
latency (median over repetitions of the per-process median), max abs error vs eager.

    .venv/bin/python bench/bench_passes.py [--models gpt2 llama bert resnet18] [--reps 3]
                                           [--iters 100] [--out bench/results]

Writes OUT/passes.json and OUT/passes.md.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
DEFAULT_MODELS = ["gpt2", "llama", "mistral", "bert", "t5", "vit", "resnet18"]
TRANSFORMERS = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi", "gpt_neox", "gemma", "opt", "bert"}
TRANSFORMERS |= {"roberta", "electra", "albert", "distilbert", "t5", "bart", "vit", "swin"}
VARIANTS = {"on": {}, "off": {"cleanup": False, "fusion": False}}


def _child(args) -> None:
    import copy

    import torch

    sys.path.insert(0, str(TESTS))
    import zoo

    import tpuc
    from tpuc import compiled_graph, dump

    exes: list = []
    real_record = compiled_graph.record_compile

    def record(exe):
        exes.append(exe)
        real_record(exe)

    compiled_graph.record_compile = record
    torch._dynamo.config.recompile_limit = 64
    # Pay the process's one-time XLA/LLVM setup on an unrelated graph, so the first variant's
    # compile time is not inflated by it.
    warm = torch.compile(lambda t: (t * 2).sum(0), backend="tpu", options={"cache_dir": None})
    warm(torch.randn(3, 5))
    del exes[:]
    model, inputs = zoo.make(args.model)
    with torch.no_grad():
        ref = model(*inputs)
    order = ["on", "off"] if args.first == "on" else ["off", "on"]
    result: dict = {"model": args.model, "order": order, "variants": {}}
    compiled = {}
    for v in order:
        m = model if v == order[0] else copy.deepcopy(model)
        tpuc.reset_stats()
        start = len(exes)
        c = torch.compile(m, backend="tpu", options={"cache_dir": None, "passes": VARIANTS[v]})
        t0 = time.perf_counter()
        with torch.no_grad():
            out = c(*inputs)
        first = time.perf_counter() - t0
        mine = exes[start:]
        stats = tpuc.stats()
        shlo = [dump.stablehlo_op_counts(e.mlir) for e in mine]
        result["variants"][v] = {
            "graphs": len(mine),
            "stablehlo_ops": sum(
                n for counts in shlo for k, n in counts.items() if k not in dump.STRUCTURAL_OPS
            ),
            "stablehlo_op_counts": {
                k: sum(c.get(k, 0) for c in shlo) for k in sorted({k for c in shlo for k in c})
            },
            "ir_ops": sum(sum(dump.ir_op_counts(e.graph_text).values()) for e in mine),
            "xla_compile_seconds": sum(e.compile_seconds for e in mine if e.cache == "miss"),
            # When both variants give the same module, the second finds it in memory.
            "all_compiled": all(e.cache == "miss" for e in mine),
            "lower_seconds": sum(e.lower_seconds for e in mine),
            "first_call_seconds": first,
            "passes": stats["passes"],
            "max_abs_err": (out - ref).abs().max().item(),
        }
        compiled[v] = c
    # Steady state, interleaved.
    times: dict = {v: [] for v in order}
    with torch.no_grad():
        for _ in range(args.warmup):
            for v in order:
                compiled[v](*inputs)
        for i in range(args.iters):
            for v in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                compiled[v](*inputs)
                times[v].append(time.perf_counter() - t0)
    for v in order:
        result["variants"][v]["latency_ms"] = statistics.median(times[v]) * 1e3
    print("RESULT " + json.dumps(result))


def _run_child(model: str, first: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--first", first]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("TPUC_DUMP_DIR", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{model}: child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(off: float | None, on: float | None) -> str:
    return f"{(on - off) / off * 100:+.1f}%" if off and on is not None else "n/a"


def _s(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "n/a"


def _summarize(model: str, runs: list[dict]) -> dict:
    out = {"model": model, "transformer": model in TRANSFORMERS, "reps": len(runs)}
    for v in VARIANTS:
        vs = [r["variants"][v] for r in runs]
        out[v] = {
            "graphs": vs[0]["graphs"],
            "stablehlo_ops": vs[0]["stablehlo_ops"],
            "ir_ops": vs[0]["ir_ops"],
            # only processes where every graph of this variant was compiled (not a memory hit)
            "xla_compile_seconds": _median([x["xla_compile_seconds"] for x in vs if x["all_compiled"]]),
            "xla_compile_seconds_all": [x["xla_compile_seconds"] if x["all_compiled"] else None for x in vs],
            "lower_seconds": statistics.median(x["lower_seconds"] for x in vs),
            "latency_ms": statistics.median(x["latency_ms"] for x in vs),
            "latency_ms_all": [x["latency_ms"] for x in vs],
            "max_abs_err": max(x["max_abs_err"] for x in vs),
            "stablehlo_op_counts": vs[0]["stablehlo_op_counts"],
            "passes": vs[0]["passes"],
        }
        if len({x["stablehlo_ops"] for x in vs}) != 1:
            out[v]["stablehlo_ops_varied"] = [x["stablehlo_ops"] for x in vs]
    return out


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# IR passes on vs off",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['reps']} process(es) per model, "
        f"{meta['iters']} timed calls per variant per process (interleaved). Command: `{meta['command']}`",
        "",
        "StableHLO ops: ops of the module sent to PJRT (module/func/return not counted), summed over "
        "the model's graphs. Compile: XLA compile seconds (median over the processes that compiled "
        "the variant: identical modules are compiled once per process). Latency: "
        "steady-state median per call (median over processes). Off = "
        '`options={"passes": {"cleanup": False, "fusion": False}}`.',
        "",
        "| model | StableHLO ops off | on | change | IR ops off | on | XLA compile s off | on | change "
        "| latency ms off | on | change | max err on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append(
            f"| {r['model']} | {off['stablehlo_ops']} | {on['stablehlo_ops']} | "
            f"{_pct(off['stablehlo_ops'], on['stablehlo_ops'])} | {off['ir_ops']} | {on['ir_ops']} | "
            f"{_s(off['xla_compile_seconds'])} | {_s(on['xla_compile_seconds'])} | "
            f"{_pct(off['xla_compile_seconds'], on['xla_compile_seconds'])} | "
            f"{off['latency_ms']:.3f} | {on['latency_ms']:.3f} | {_pct(off['latency_ms'], on['latency_ms'])} | "
            f"{on['max_abs_err']:.1e} |"
        )
    tr = [r for r in rows if r["transformer"]]
    if tr:
        red = [1 - r["on"]["stablehlo_ops"] / r["off"]["stablehlo_ops"] for r in tr]
        lines += [
            "",
            f"Transformer models: StableHLO ops {statistics.mean(red) * 100:.1f}% fewer on average "
            f"(min {min(red) * 100:.1f}%, max {max(red) * 100:.1f}%; target: at least 25%).",
        ]
    # Per-pass contributions (IR ops removed, summed over models; first process).
    names: list[str] = []
    for r in rows:
        for n in r["on"]["passes"]:
            if n not in names:
                names.append(n)
    if names:
        lines += ["", "IR ops removed per pass (pipeline order; changes = nodes rewritten or removed):", ""]
        lines.append("| model | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for r in rows:
            p = r["on"]["passes"]
            cells = [f"{p[n]['ops_removed']} ({p[n]['changes']})" if n in p else "-" for n in names]
            lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--first", default="on", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    import torch

    rows = []
    for model in args.models:
        runs = []
        for rep in range(args.reps):
            first = "on" if rep % 2 == 0 else "off"
            t0 = time.perf_counter()
            runs.append(_run_child(model, first, args))
            print(f"{model} rep {rep + 1}/{args.reps} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        row = _summarize(model, runs)
        rows.append(row)
        off, on = row["off"], row["on"]
        print(
            f"{model}: StableHLO ops {off['stablehlo_ops']} -> {on['stablehlo_ops']} "
            f"({_pct(off['stablehlo_ops'], on['stablehlo_ops'])}), compile "
            f"{_s(off['xla_compile_seconds'])} -> {_s(on['xla_compile_seconds'])} s, latency "
            f"{off['latency_ms']:.3f} -> {on['latency_ms']:.3f} ms",
            file=sys.stderr,
        )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "torch": torch.__version__,
        "reps": args.reps,
        "iters": args.iters,
        "command": "python bench/bench_passes.py " + " ".join(sys.argv[1:]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "passes.json").write_text(json.dumps({"meta": meta, "models": rows}, indent=2))
    md = _markdown(rows, meta)
    (args.out / "passes.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
