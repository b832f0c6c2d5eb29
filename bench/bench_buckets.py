"""Bounded dynamism benchmark (issue 5, "Done when"): a stream of calls of a small decoder LM with
random sequence lengths, through

- tpuc with buckets: `mark_dynamic(ids, 1, min=2, max=MAX)` and pow2 buckets;
- tpuc with `dynamic=False`: every new length is a new Dynamo trace and a new XLA compile;
- Inductor with `dynamic=True`: one symbolic trace, one (dynamic-shape) kernel set.

Each variant runs in its own process (fresh Dynamo state) over the same seeded lengths; the same
process checks every result against eager. Reported: XLA compiles (tpuc), Dynamo traces (graphs
Dynamo handed to the backend), total wall time of the stream, max abs error vs eager.

    .venv/bin/python bench/bench_buckets.py [--model llama] [--calls 200] [--max-len 256]
                                            [--out bench/results]

Writes OUT/buckets.json and OUT/buckets.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
VARIANTS = ["tpuc_buckets", "tpuc_static", "inductor_dynamic"]


def _child(args) -> None:
    import torch

    sys.path.insert(0, str(TESTS))
    import zoo

    import tpuc

    torch._dynamo.config.recompile_limit = 10_000
    torch._dynamo.config.accumulated_recompile_limit = 10_000
    model, _ = zoo.make(args.model)
    rng = random.Random(args.seed)
    lengths = [rng.randint(1, args.max_len) for _ in range(args.calls)]
    # The first call carries the mark, and PyTorch specializes a size of 1: start with one >= 2.
    first = next(i for i, n in enumerate(lengths) if n >= 2)
    lengths[0], lengths[first] = lengths[first], lengths[0]
    traces = 0

    def counting(backend, **kw):
        def wrapped(gm, example_inputs):
            nonlocal traces
            traces += 1
            return backend(gm, example_inputs, **kw) if kw else backend(gm, example_inputs)

        return wrapped

    v = args.child
    if v == "tpuc_buckets":
        from tpuc.backend import tpu_backend

        compiled = torch.compile(model, backend=counting(tpu_backend, options={"cache_dir": None}))
    elif v == "tpuc_static":
        from tpuc.backend import tpu_backend

        compiled = torch.compile(
            model, backend=counting(tpu_backend, options={"cache_dir": None}), dynamic=False
        )
    else:
        from torch._inductor.compile_fx import compile_fx

        compiled = torch.compile(model, backend=counting(compile_fx), dynamic=True)
    tpuc.reset_stats()
    worst = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, n in enumerate(lengths):
            ids = torch.randint(0, zoo.VOCAB, (1, n))
            if i == 0 and v == "tpuc_buckets":
                torch._dynamo.mark_dynamic(ids, 1, min=2, max=args.max_len)
            out = compiled(ids)
            worst = max(worst, (out - model(ids)).abs().max().item())
    wall = time.perf_counter() - t0
    stats = tpuc.stats()
    print(
        json.dumps(
            {
                "variant": v,
                "wall_seconds": wall,
                "dynamo_traces": traces,
                "xla_compiles": stats["xla_compiles"] if v != "inductor_dynamic" else None,
                "distinct_lengths": len(set(lengths)),
                "max_abs_err": worst,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="*", default=VARIANTS)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    rows = []
    for v in args.variants:
        cmd = [sys.executable, __file__, "--child", v, "--model", args.model, "--calls", str(args.calls)]
        cmd += ["--max-len", str(args.max_len), "--seed", str(args.seed)]
        print(f"running {v} ...", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TPUC_LOG": "error"})
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{v} failed")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr)
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python bench/bench_buckets.py " + " ".join(sys.argv[1:]),
        "model": f"zoo:{args.model} (tests/zoo.py), batch 1",
        "calls": args.calls,
        "lengths": f"uniform random in [1, {args.max_len}], seed {args.seed}",
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "buckets.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    best = min(r["wall_seconds"] for r in rows)
    lines = [
        "# Bounded dynamism: a stream of random sequence lengths",
        "",
        f"{info['date']}: {info['model']}, {info['calls']} calls, lengths {info['lengths']} "
        f"({rows[0]['distinct_lengths']} distinct), {info['cpus']} CPUs. Command: `{info['command']}`.",
        "",
        "| variant | Dynamo traces | XLA compiles | wall time (s) | vs fastest | max abs err vs eager |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {
        "tpuc_buckets": "tpuc, buckets (pow2, max declared)",
        "tpuc_static": "tpuc, `dynamic=False`",
        "inductor_dynamic": "Inductor, `dynamic=True`",
    }
    for r in rows:
        xla = "-" if r["xla_compiles"] is None else r["xla_compiles"]
        lines.append(
            f"| {names[r['variant']]} | {r['dynamo_traces']} | {xla} | {r['wall_seconds']:.1f} | "
            f"{r['wall_seconds'] / best:.2f}x | {r['max_abs_err']:.1e} |"
        )
    (args.out / "buckets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
