"""The zoo on an NVIDIA GPU: tpuc with the CUDA PJRT plugin against eager CUDA and Inductor on CUDA,
same model, same inputs, one process, interleaved rounds (scripts/device_check.sh runs it).

Per model: tpuc's output checked against eager CUDA (float32, rtol/atol 1e-4: GPU reductions
reorder sums), then --iters timed calls of each backend in rotated order per round, each call
synchronized; median latency and the ratios tpuc/eager and tpuc/Inductor; first-call times.

    .venv/bin/python bench/bench_gpu.py [--models gpt2 bert ...] [--iters 50] [--out bench/results]

Writes OUT/gpu.json and OUT/gpu.md. Needs a CUDA device and the CUDA plugin
(`scripts/setup.sh --plugin cuda`)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import zoo  # noqa: E402

import tpuc  # noqa: E402


def _sync() -> None:
    torch.cuda.synchronize()


def _timed(fn, *args) -> float:
    _sync()
    t = time.perf_counter()
    fn(*args)
    _sync()
    return time.perf_counter() - t


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def bench_model(name: str, iters: int) -> dict:
    model, inputs = zoo.make(name)
    model = model.cuda()
    inputs = tuple(_to(x, "cuda") for x in inputs)
    row: dict = {"model": name}
    with torch.no_grad():
        expected = model(*inputs)
        fns = {"eager": model}
        for backend, kwargs in (
            ("inductor", {"backend": "inductor"}),
            ("tpuc", {"backend": "tpu", "options": {"plugin": "cuda", "fallback": "error"}}),
        ):
            torch._dynamo.reset()
            fn = torch.compile(model, dynamic=False, **kwargs)
            try:
                row[f"{backend}_first_s"] = _timed(fn, *inputs)
            except Exception as e:  # report and go on with the other models
                row[f"{backend}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            fns[backend] = fn
        if "tpuc" in fns:
            got = fns["tpuc"](*inputs)
            err = (got.to("cuda").float() - expected.float()).abs().max().item()
            scale = expected.float().abs().max().item()
            row["tpuc_max_abs_error"], row["scale"] = err, scale
            row["tpuc_matches"] = err <= 1e-4 + 1e-4 * scale
        times: dict[str, list[float]] = {b: [] for b in fns}
        order = list(fns)
        for r in range(iters):
            for b in order[r % len(order) :] + order[: r % len(order)]:
                times[b].append(_timed(fns[b], *inputs))
    for b, ts in times.items():
        row[f"{b}_ms"] = statistics.median(ts) * 1e3
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(zoo.NAMES), choices=list(zoo.NAMES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device", file=sys.stderr)
        return 2
    rows = []
    for name in args.models:
        try:
            rows.append(bench_model(name, args.iters))
        except Exception:
            rows.append({"model": name, "error": traceback.format_exc(limit=3)[-500:]})
        print(json.dumps(rows[-1]), flush=True)
    ratios = [r["tpuc_ms"] / r["inductor_ms"] for r in rows if "tpuc_ms" in r and "inductor_ms" in r]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(
        json.dumps({"date": now, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
    )
    lines = [
        "# The zoo on a GPU: tpuc (CUDA PJRT plugin) vs eager CUDA and Inductor CUDA",
        "",
        f"{now}, {torch.cuda.get_device_name()}, torch {torch.__version__}, tpuc {tpuc.__version__}. "
        f"Command: `python bench/bench_gpu.py --iters {args.iters}`. Median ms per call (synchronized), "
        f"interleaved rounds. Geomean tpuc/Inductor: {geomean:.2f}x.",
        "",
        "| model | matches eager | eager ms | Inductor ms | tpuc ms | tpuc/eager | tpuc/Inductor | tpuc first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e, i, t = r.get("eager_ms"), r.get("inductor_ms"), r.get("tpuc_ms")
        ok = r.get("tpuc_matches", r.get("tpuc_error") or r.get("error", "?"))
        lines.append(
            f"| {r['model']} | {ok} | {e or float('nan'):.3f} | {i or float('nan'):.3f} | {t or float('nan'):.3f} | "
            f"{(t / e) if t and e else float('nan'):.2f} | {(t / i) if t and i else float('nan'):.2f} | "
            f"{r.get('tpuc_first_s', float('nan')):.1f} |"
        )
    (args.out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
