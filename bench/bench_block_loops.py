#!/usr/bin/env python
"""Marked GPT-2 blocks as one loop (`regions="loop"`, python/tpuc/block_loops.py) against one
executable per region (`"executables"`) and the blocks inlined (`"inline"`): for a TPU target
(compile-only, no TPU needed) the executables, XLA:TPU compile seconds and XLA's cost analysis
(flops, bytes accessed) at 2 and 12 layers; optionally JAX's twins (bench/tpu_twins/depth.py)
and tpuc's dumped modules compiled again side by side in one process; and on the CPU plugin the steady time of a call, loop against inlined.

    .venv/bin/python bench/bench_block_loops.py --layers 2 12 --target tpu:v5e:1x1 \
        [--jax-python ../jaxtpu/bin/python] [--cpu-calls 10] [--out bench/results/block_loops]

Each compile runs in a fresh process with empty caches. On a shared machine compare the ratios
of one run (compile seconds move by +-30% between runs under load)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

TARGET_VARIANTS = ("executables", "loop", "inline")
CPU_VARIANTS = ("inline", "loop")


def _model(layers: int, training: bool = False):
    import torch
    from bench_regions import build, mark_blocks

    model, inputs, block = build(f"gpt2{layers}")
    mark_blocks(model, block)
    if not training:
        return model, inputs
    # Without dropout: a block that draws random numbers is not looped (block_loops.py).
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "attn_dropout"):  # GPT-2's attention passes `attn_dropout.p` to SDPA
            m.attn_dropout.p = 0.0
    return model.train(), inputs


def tpu_compile(layers: int, variant: str, target: str, training: bool, dump: str | None = None) -> dict:
    import tpuc

    model, inputs = _model(layers, training)
    t0 = time.perf_counter()
    options = {"target": target, "cache_dir": None, "regions": variant}
    options.update({"dump_dir": dump} if dump else {})
    report = tpuc.precompile(model, list(inputs), training=training, options=options)
    cost = {"flops": 0.0, "bytes accessed": 0.0}
    for g in report["per_graph"]:
        for k in cost:
            cost[k] += (g.get("cost") or {}).get(k, 0.0)
    s = tpuc.stats()
    return {
        "seconds": time.perf_counter() - t0,
        "xla": report["compile_seconds"],
        "executables": report["executables"],
        "per_graph": {g["name"]: round(g["compile_seconds"], 2) for g in report["per_graph"]},
        "loops": s["regions_looped"],
        **cost,
    }


def cpu_steady(layers: int, variant: str, calls: int) -> dict:
    import torch

    import tpuc

    model, inputs = _model(layers)
    fn = torch.compile(model, backend="tpu", options={"cache_dir": None, "regions": variant})
    times = []
    with torch.no_grad():
        ref = model(*inputs).logits
        err = (fn(*inputs).logits - ref).abs().max().item()
        for _ in range(calls):
            t = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - t)
    times.sort()
    return {
        "median_ms": 1e3 * times[len(times) // 2],
        "min_ms": 1e3 * times[0],
        "err": err,
        "loops": tpuc.stats()["regions_looped"],
    }


def _run(*argv) -> dict:
    env = dict(
        os.environ,
        TPUC_CACHE_DIR=tempfile.mkdtemp(prefix="tpuc-bench-loops-"),
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="tpuc-bench-loops-torch-"),
    )
    proc = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def jax_scan(jax_python: str, dumps: dict) -> dict:
    """JAX's GPT-2 124M twins (12 blocks; bench/tpu_twins/depth.py) at tpuc's matmul precision
    ("highest") and tpuc's dumped modules `dumps` ({name: folder}), compiled in one process (one
    libtpu, the same load) for v5e."""
    script = Path(__file__).parent / "tpu_twins" / "depth.py"
    argv = [jax_python, str(script), "--topology", "v5e:2x2", "--precision", "highest", "--reps", "2"]
    argv += [f"--tpuc={k}={v}" for k, v in dumps.items()]
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])["seconds"]
    raise SystemExit(f"depth.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    p.add_argument("--target", default="tpu:v5e:1x1")
    p.add_argument(
        "--variants", nargs="*", default=list(TARGET_VARIANTS), help="for the target (none: skip it)"
    )
    p.add_argument("--training", action="store_true", help="compile the forward and backward graphs")
    p.add_argument("--jax-python", help="a Python with jax[tpu]: compile JAX's scan twin too")
    p.add_argument("--cpu-calls", type=int, default=0, help="steady calls on the CPU plugin per variant")
    p.add_argument("--out", type=Path, help="write OUT.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child == "tpu":
        out = tpu_compile(a.layers[0], a.variant, a.target, a.training, a.dump)
        print("RESULT " + json.dumps(out))
        return
    if a.child == "cpu":
        print("RESULT " + json.dumps(cpu_steady(a.layers[0], a.variant, a.cpu_calls)))
        return
    results: dict = {"target": a.target, "training": a.training, "tpu": {}, "cpu": {}}
    dumps = {}
    for layers in a.layers:
        for v in a.variants:
            dumps[f"{v}{layers}"] = tempfile.mkdtemp(prefix=f"tpuc-bench-loops-{v}{layers}-")
            argv = ["--child", "tpu", "--layers", str(layers), "--variant", v, "--target", a.target]
            argv += ["--dump", dumps[f"{v}{layers}"]]
            r = _run(*argv, *(["--training"] if a.training else []))
            results["tpu"][f"{v} L={layers}"] = r
            print(f"tpu {v:12s} L={layers:2d}", json.dumps(r), flush=True)
    if a.jax_python:
        results["jax"] = jax_scan(a.jax_python, dumps)
        print("jax", json.dumps(results["jax"]), flush=True)
    if a.cpu_calls:
        for layers in a.layers:
            for v in CPU_VARIANTS:
                r = _run(
                    "--child", "cpu", "--layers", str(layers), "--variant", v, "--cpu-calls", str(a.cpu_calls)
                )
                results["cpu"][f"{v} L={layers}"] = r
                print(f"cpu {v:12s} L={layers:2d}", json.dumps(r), flush=True)
    if a.out:
        a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
