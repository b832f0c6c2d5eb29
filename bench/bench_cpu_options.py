"""tpuc on the CPU plugin with XLA:CPU's YNNPACK fusions on (XLA's default) and off, side by side.

Per case, one process: the model compiled once per variant (`tpuc._native.set_cpu_ynn_fusion_types`
chooses the compile options of each; they are part of the executable's cache key, so neither
reuses the other's executables), each checked against eager, then --iters rounds of one timed
call per variant after two untimed rounds, the order rotated every round so that load on this
shared machine hits all alike; median per variant. Training cases time the whole step compiled
(one program) and the model alone compiled (the step split), each both ways.

Cases: bench_real.py's inference and training cases (real-size models), and small models of
tests/models.py (`models:NAME`, bench_models.py's) and tests/zoo.py (`zoo:NAME`).

    .venv/bin/python bench/bench_cpu_options.py [--cases resnet50_train_b8 models:mlp ...]
                                                [--iters N] [--small-iters N] [--out bench/results]

Writes OUT/cpu-options.json and OUT/cpu-options.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_real  # bench/, beside this script
import results_history

ROOT = Path(__file__).resolve().parent.parent
# name -> the value of xla_cpu_experimental_ynn_fusion_type (None: XLA's default). The first is
# the baseline of the ratios.
VARIANTS = {
    "ynn_on": None,
    "ynn_off": "",
    # XLA:CPU's dots kept in YNNPACK, its reductions left to XLA's own loop fusions.
    "ynn_dots_only": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
SMALL = [
    "models:mlp",
    "models:preln",
    "models:postln",
    "models:convnet",
    "zoo:gpt2",
    "zoo:vit",
    "zoo:resnet18",
]
REAL = [c for c, (kind, _, _) in bench_real.CASES.items() if kind in ("infer", "train") and c != "unet_step"]


def _build(torch, case: str):
    """(kind, model, inputs, pick)."""
    family, _, name = case.partition(":")
    if family == "models":
        sys.path.insert(0, str(ROOT / "tests"))
        import models

        model, inputs = models.make(name, torch.float32, batch=bench_models_batch(name))
        return "infer", model, inputs, lambda out: out
    if family == "zoo":
        sys.path.insert(0, str(ROOT / "tests"))
        import zoo

        model, inputs = zoo.make(name)
        return "infer", model, inputs, lambda out: out
    kind, model, inputs, pick = bench_real.build(torch, case)
    return kind, model, inputs, pick


def bench_models_batch(name: str) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_models

    return bench_models.DEFAULT_BATCH[name]


def child(case: str, iters: int, variants: list[str]) -> dict:
    import copy

    import torch

    import tpuc
    from tpuc import _native

    torch.manual_seed(0)
    kind, model, inputs, pick = _build(torch, case)
    cache = Path(os.environ["TPUC_CACHE_DIR"])

    def compile_for(v: str, fn):
        # A cache folder per variant: options that differ make Dynamo trace each variant anew
        # (equal ones would reuse the first variant's compiled graphs).
        return torch.compile(fn, backend="tpu", options={"cache_dir": str(cache / v)})

    out: dict = {"kind": kind}
    calls = {}

    def compiles() -> int:
        return tpuc.stats()["xla_compiles"]

    def with_variant(types: str | None, fn):
        # Set at each call: a recompile (a guard that fails later) gets this variant's options.
        def call():
            _native.set_cpu_ynn_fusion_types(types)
            return fn()

        return call

    if kind == "infer":
        with torch.no_grad():
            expected = pick(model(*inputs))
            for v in variants:
                types = VARIANTS[v]
                fn = compile_for(v, model)
                call = with_variant(types, lambda fn=fn: pick(fn(*inputs)))
                c0, t0 = compiles(), time.perf_counter()
                got = call()
                out[v] = {
                    "first_call_s": time.perf_counter() - t0,
                    "xla_compiles": compiles() - c0,
                    "max_rel_err": bench_real._max_rel_err(torch, got, expected),
                }
                calls[v] = call
            samples = bench_real._interleave(calls, lambda f: f(), iters, out)
    else:
        model.train()

        def make_step(m, whole: bool, v: str):
            fn = m if whole else compile_for(v, m)
            opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = pick(fn(*inputs)).float().square().mean()
                loss.backward()
                opt.step()
                return loss.detach()

            return compile_for(v, step) if whole else step

        # The first step's loss in eager (computed before the update, as each variant's first).
        ref_loss = pick(copy.deepcopy(model)(*inputs)).float().square().mean().item()
        for road in ("whole", "split"):
            for v in variants:
                types = VARIANTS[v]
                name = f"{road}_{v}"
                call = with_variant(types, make_step(copy.deepcopy(model), road == "whole", name))
                c0, t0 = compiles(), time.perf_counter()
                loss = call().item()
                out[name] = {
                    "first_call_s": time.perf_counter() - t0,
                    "xla_compiles": compiles() - c0,
                    "max_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                }
                call()
                calls[name] = call
        samples = bench_real._interleave(calls, lambda f: f(), iters, out)
    for v, times in samples.items():
        out[v]["median_ms"] = statistics.median(times) * 1e3
        out[v]["min_ms"] = min(times) * 1e3
    return out


def _run_child(case: str, args, cache: Path) -> dict:
    env = dict(os.environ)
    for k in ("TPUC_LOG", "TPUC_DUMP_DIR", "XLA_FLAGS"):
        env.pop(k, None)
    env["TPUC_CACHE_DIR"] = str(cache / case.replace(":", "_") / "tpuc")
    # AOTAutograd's cache holds tpuc's executables too: fresh, so each variant compiles.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / case.replace(":", "_") / "inductor")
    iters = args.iters if case in bench_real.CASES else args.small_iters
    cmd = [sys.executable, __file__, "--child", case, "--iters", str(iters), "--variants", *args.variants]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()] or ["failed"]
        return {"error": lines[-1][:300], "wall_s": time.perf_counter() - t0}
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def markdown(report: dict) -> str:
    info = report["info"]
    lines = [
        f"# tpuc on the CPU plugin with XLA:CPU's YNNPACK fusions as XLA makes them and fewer, {info['date']}",
        "",
        f"torch {info['torch']}, {info['cpus']} CPUs; load average {info['load_start']:.2f} at start, "
        f"{info.get('load_end', float('nan')):.2f} at end; per case one process, {info['iters']} "
        f"interleaved rounds ({info['small_iters']} for the small models) after 2 untimed ones, median. Command: `{info['command']}`.",
        "",
    ]
    variants = list(info["variants"])
    base = variants[0]
    lines += [
        "Variants (xla_cpu_experimental_ynn_fusion_type; none: XLA's default): "
        + ", ".join(
            f"`{v}` = {json.dumps(t) if t is not None else 'none'}" for v, t in info["variants"].items()
        )
        + ".",
        "",
        "| case | "
        + " | ".join(f"{v} ms" for v in variants)
        + " | "
        + " | ".join(f"{v} / {base}" for v in variants[1:])
        + " | XLA compiles | error vs eager |",
        "|---|" + "---:|" * (2 * len(variants) - 1) + "---|---|",
    ]

    def ms(x):
        return f"{x:.1f}" if x >= 10 else f"{x:.3f}"

    def row(case, r, prefix):
        got = [r.get(prefix + v, {}) for v in variants]
        if any("median_ms" not in g for g in got):
            err = r.get("error") or next((g["error"] for g in got if "error" in g), "-")
            return (
                f"| {case} | "
                + " | ".join("-" for _ in range(2 * len(variants) - 1))
                + f" | - | {err[:80]} |"
            )
        return (
            f"| {case} | "
            + " | ".join(ms(g["median_ms"]) for g in got)
            + " | "
            + " | ".join(f"{g['median_ms'] / got[0]['median_ms']:.3f}x" for g in got[1:])
            + " | "
            + " / ".join(str(g["xla_compiles"]) for g in got)
            + " | "
            + " / ".join(f"{g['max_rel_err']:.1e}" for g in got)
            + " |"
        )

    for case, r in report["cases"].items():
        if r.get("kind") == "train":
            lines.append(row(f"{case}, whole step", r, "whole_"))
            lines.append(row(f"{case}, split step", r, "split_"))
        else:
            lines.append(row(case, r, ""))
    lines.append(
        "\nerror vs eager: largest |tpuc - eager| over the largest |eager| of the output (training: "
        "of the first step's loss). XLA compiles: the variant's first call compiled its own "
        "executables (none reused from the other variant)."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=REAL + SMALL)
    ap.add_argument("--iters", type=int, default=5, help="rounds for bench_real.py's cases")
    ap.add_argument("--variants", nargs="+", default=["ynn_on", "ynn_off"], choices=list(VARIANTS))
    ap.add_argument("--small-iters", type=int, default=200, help="rounds for the small models")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--append", action="store_true", help="keep the cases already in the result file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.iters, args.variants)))
        return 0

    import torch

    report = {
        "info": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "iters": args.iters,
            "variants": {v: VARIANTS[v] for v in args.variants},
            "small_iters": args.small_iters,
            "load_start": os.getloadavg()[0],
            "command": "python bench/bench_cpu_options.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "cases": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "cpu-options.json"
    if args.append and out_json.is_file():
        previous = json.loads(out_json.read_text())
        report["cases"] = previous["cases"]
        report["info"]["date"] = previous["info"]["date"]
        report["info"]["load_start"] = previous["info"]["load_start"]
    with tempfile.TemporaryDirectory(prefix="tpuc-bench-cpu-options-") as tmp:
        for case in args.cases:
            r = _run_child(case, args, Path(tmp))
            report["cases"][case] = r
            print(
                case,
                json.dumps({k: v.get("median_ms") if isinstance(v, dict) else v for k, v in r.items()}),
                flush=True,
            )
            report["info"]["load_end"] = os.getloadavg()[0]
            out_json.write_text(json.dumps(report, indent=1) + "\n")
            results_history.write_markdown(args.out / "cpu-options.md", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
