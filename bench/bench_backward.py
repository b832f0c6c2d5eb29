#!/usr/bin/env python
"""XLA:TPU compile seconds of a small CNN's training graphs (issue 49's 2-conv CNN: conv 3->16,
ReLU, 2x2 max pooling, conv 16->32, ReLU, adaptive average pooling to 4x4, linear; batch 8 at
3x32x32), against its JAX twin (bench/tpu_twins/cnn.py), side by side in one process.

tpuc's forward and backward are lowered for v5e (`tpuc.precompile(..., training=True)` with a
dump), then bench/tpu_twins/compile_modules.py compiles, in one process with `--jax-python`
(a python with jax[tpu]==0.10.2): tpuc's forward, tpuc's backward, each `--before` module (e.g.
the backward as an earlier tpuc lowered it, kept in bench/results/backward_compile/), and the
twin's gradient at HIGHEST (tpuc's precision: PyTorch's float32 matmul precision, "highest"
unless set), then tpuc's backward with `options={"precision": "default"}` and the twin at JAX's
default precision (one bf16 pass on a TPU). Writes bench/results/backward_compile.{md,json}.

    .venv/bin/python bench/bench_backward.py --jax-python ../jaxtpu/bin/python [--repeat 2]
        [--before bench/results/backward_compile/cnn_backward_abf8796.mlir]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

import tpuc

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    )


def tpuc_modules(folder: Path, precision: str) -> dict[str, Path]:
    """{"forward": path, "backward": path}: the CNN's training graphs lowered for v5e at
    `precision` (tpuc's option)."""
    dump = folder / f"dump_{precision}"
    torch._dynamo.reset()
    tpuc.precompile(
        cnn(),
        [torch.randn(8, 3, 32, 32)],
        options={
            "target": "tpu:v5e:2x2",
            "precision": precision,
            "dump_dir": str(dump),
            "cache_dir": str(folder / "cache"),
        },
        training=True,
    )
    found = {}
    for kind in ("forward", "backward"):
        (path,) = dump.glob(f"*_{kind}_*/stablehlo.mlir")
        found[kind] = folder / f"tpuc_{kind}_{precision}.mlir"
        shutil.copy(path, found[kind])
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jax-python", required=True)
    ap.add_argument("--before", nargs="*", default=[])
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mods = tpuc_modules(Path(tmp), "highest")
        default = tpuc_modules(Path(tmp), "default")
        items = [
            str(mods["forward"]),
            str(mods["backward"]),
            *a.before,
            "twin:cnn:highest",
            str(default["backward"]),
            "twin:cnn",
        ]
        r = subprocess.run(
            [a.jax_python, str(HERE / "tpu_twins" / "compile_modules.py"), "--repeat", str(a.repeat), *items],
            capture_output=True,
            text=True,
            check=True,
        )
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    runs = json.loads(line[len("RESULT ") :])
    names = {
        str(mods["forward"]): "tpuc forward (now)",
        str(mods["backward"]): "tpuc backward (now)",
        str(default["backward"]): "tpuc backward (now), `precision: default`",
        "twin:cnn": "JAX twin gradient, default precision",
        "twin:cnn:highest": "JAX twin gradient, HIGHEST",
    }
    for b in a.before:
        names[b] = f"tpuc backward as `{Path(b).name}`"
    rows = {}
    for run in runs:
        rows.setdefault(run["item"], []).append(run)
    lines = [
        f"## {datetime.date.today()}: 2-conv CNN, v5e, compile-only (`bench/bench_backward.py`, repeat {a.repeat})",
        "",
        "| module | compile s (each run) | bytes accessed | flops |",
        "|---|---|---|---|",
    ]
    for item, rs in rows.items():
        secs = " / ".join(f"{x['seconds']:.1f}" for x in rs)
        lines.append(f"| {names[item]} | {secs} | {rs[0]['bytes accessed']:.3g} | {rs[0]['flops']:.3g} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = RESULTS / "backward_compile.md"
    old = out.read_text() if out.exists() else "# Backward compile seconds against the JAX twin\n\n"
    head, _, rest = old.partition("\n\n")
    out.write_text(head + "\n\n" + text + "\n" + rest)
    (RESULTS / "backward_compile.json").write_text(json.dumps({"runs": runs, "names": names}, indent=1))


if __name__ == "__main__":
    main()
