"""Sharding benchmark (issue 6, "Done when"): one zoo model's training step (Llama, loss + backward)
on 1, 2 and 4 CPU devices under each strategy, in one process: per-device bytes of the parameters
kept resident, the step time (median of --steps after warm-up), the collectives XLA inserted, and
the largest difference of loss and gradients from eager PyTorch.

On the CPU plugin every "device" shares the same two cores, so step times measure overhead, not
scaling; the memory ratios and the matching results are what carries over to a TPU slice or GPUs.

    .venv/bin/python bench/bench_sharding.py [--model llama] [--batch 8] [--steps 10] [--out bench/results]

Writes OUT/sharding.json and OUT/sharding.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TPUC_CPU_DEVICES", "4")

import torch  # noqa: E402
import zoo  # noqa: E402

import tpuc  # noqa: E402

CONFIGS = [
    ("one device", None, "replicated"),
    ("data_parallel", {"shape": [2], "axes": ["data"]}, "data_parallel"),
    ("data_parallel", {"shape": [4], "axes": ["data"]}, "data_parallel"),
    ("fsdp", {"shape": [2], "axes": ["data"]}, "fsdp"),
    ("fsdp", {"shape": [4], "axes": ["data"]}, "fsdp"),
    ("tensor_parallel", {"shape": [2], "axes": ["model"]}, "tensor_parallel"),
    ("tensor_parallel", {"shape": [4], "axes": ["model"]}, "tensor_parallel"),
    ("data_parallel, model axis unused", {"shape": [2, 2], "axes": ["data", "model"]}, "data_parallel"),
]


def collectives(dump: Path) -> dict:
    out = Counter()
    for path in dump.glob("*/optimized_hlo.txt"):
        kind = "fw" if "_forward" in path.parent.name else "bw"
        for op in re.findall(
            r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(", path.read_text()
        ):
            out[f"{kind} {op}"] += 1
    return dict(sorted(out.items()))


def run(model_name: str, batch: int, steps: int) -> list[dict]:
    lm, _ = zoo.make(model_name)
    base = zoo.LMLoss(lm.train())
    torch.manual_seed(3)
    ids = torch.randint(0, zoo.VOCAB, (batch, 16))
    target = torch.randint(0, zoo.VOCAB, (batch, 16))
    eager = copy.deepcopy(base)
    ref = eager(target, ids)
    ref.backward()
    ref_grads = [p.grad for p in eager.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rows = []
    for label, mesh, sharding in CONFIGS:
        torch._dynamo.reset()
        gc.collect()
        model = copy.deepcopy(base)
        dump = Path(tempfile.mkdtemp(prefix="tpuc-shard-"))
        opts = {"fallback": "error", "dump_dir": str(dump)}
        if mesh is not None:
            opts.update(mesh=mesh, sharding=sharding)
        compiled = torch.compile(model, backend="tpu", options=opts)
        before = tpuc.resident_bytes()
        t0 = time.perf_counter()
        loss = compiled(target, ids)
        loss.backward()
        first = time.perf_counter() - t0
        loss_err = (loss - ref).abs().item()
        grad_err = max(
            (p.grad - g).abs().max().item() for p, g in zip(model.parameters(), ref_grads, strict=True)
        )
        times = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            compiled(target, ids).backward()
            times.append(time.perf_counter() - t0)
        devices = 1 if mesh is None else int(torch.tensor(mesh["shape"]).prod())
        resident = [b - a for a, b in zip(before + [0] * devices, tpuc.resident_bytes(), strict=False)][
            :devices
        ]
        if mesh is None:
            resident = [param_bytes]  # unsharded graphs alias the parameters: all of them on device 0
        rows.append(
            {
                "config": label,
                "mesh": mesh["shape"] if mesh else [1],
                "devices": devices,
                "resident_bytes_per_device": resident,
                "resident_ratio": round(max(resident) / param_bytes, 3),
                "first_step_s": round(first, 3),
                "step_median_s": round(statistics.median(times), 4),
                "loss_max_abs_diff": loss_err,
                "grad_max_abs_diff": grad_err,
                "collectives": collectives(dump) if mesh else {},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows = run(args.model, args.batch, args.steps)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    meta = {
        "started": started,
        "model": f"zoo:{args.model} training step (batch {args.batch}, sequence 16)",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "tpuc_commit": commit,
        "command": "python bench/bench_sharding.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharding.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Sharding: one training step on 1, 2 and 4 CPU devices",
        "",
        f"{meta['started']}: {meta['model']}, torch {meta['torch']}, {meta['cpus']} CPUs, tpuc {commit}. "
        f"Command: `{meta['command']}`. All CPU devices share the same cores: step times show overhead, "
        "not scaling; memory ratios and matching results carry over to real devices.",
        "",
        "| strategy | mesh | parameter bytes per device (vs all) | step median | first step | "
        "loss diff vs eager | max grad diff vs eager | collectives (optimized HLO) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items()) or "-"
        lines.append(
            f"| {r['config']} | {'x'.join(map(str, r['mesh']))} | {r['resident_ratio']:.3f} | "
            f"{r['step_median_s'] * 1000:.1f} ms | {r['first_step_s']:.2f} s | {r['loss_max_abs_diff']:.1e} | "
            f"{r['grad_max_abs_diff']:.1e} | {coll} |"
        )
    (out / "sharding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
