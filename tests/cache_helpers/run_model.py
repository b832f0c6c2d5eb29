"""One process that compiles a reference model with backend="tpu" and a persistent cache, checks
the results against eager PyTorch, and prints a JSON report as its last line of stdout.

    python run_model.py --model mlp --batch 4 --cache-dir DIR [--sizes 8,16 --dynamic-max 16]

`--sizes`: call the compiled model with these batch sizes in turn (default: `--batch` only);
`--dynamic-max`: mark dim 0 of each input dynamic with that declared maximum
(torch._dynamo.mark_dynamic). Exit status 0 when every result matches eager, 1 otherwise (the report says which).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for models.py

import torch  # noqa: E402
from models import make  # noqa: E402

import tpuc  # noqa: E402
from tpuc import compiled_graph  # noqa: E402

# Every executable the backend obtains, in order: its cache key and where it came from, with the
# Rust-side timings (compile_seconds is the PJRT compile on a miss, the disk load on a hit).
EXECUTABLES: list[dict] = []
_record_compile = compiled_graph.record_compile


def _record(exe) -> None:
    EXECUTABLES.append(
        {
            "key": exe.key,
            "cache": exe.cache,
            "lower_seconds": exe.lower_seconds,
            "compile_seconds": exe.compile_seconds,
        }
    )
    _record_compile(exe)


compiled_graph.record_compile = _record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sizes", default=None, help="comma-separated batch sizes to call with")
    p.add_argument("--dynamic-max", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="omitted: TPUC_CACHE_DIR / default")
    p.add_argument("--no-cache", action="store_true", help="cache_dir=None")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    model, (x,) = make(args.model, batch=args.batch, seed=args.seed)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [args.batch]
    options = {"fallback": "error"}
    if args.no_cache:
        options["cache_dir"] = None
    elif args.cache_dir is not None:
        options["cache_dir"] = args.cache_dir
    compiled = torch.compile(model, backend="tpu", options=options)

    report = {"ok": True, "errors": [], "warnings": [], "calls": [], "uid": os.getuid()}
    tpuc.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in sizes:
            torch.manual_seed(args.seed + n)
            xi = torch.randn(n, *x.shape[1:], dtype=x.dtype)
            if args.dynamic_max is not None:
                torch._dynamo.mark_dynamic(xi, 0, max=args.dynamic_max)
            t0 = time.perf_counter()
            with torch.no_grad():
                got = compiled(xi)
            first = time.perf_counter() - t0
            with torch.no_grad():
                want = model(xi)
            err = (got - want).abs().max().item()
            close = got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
            report["calls"].append({"batch": n, "seconds": first, "max_abs_err": err, "close": close})
            if not close:
                report["ok"] = False
                report["errors"].append(f"batch {n}: max abs error {err}")
    report["warnings"] = [str(w.message) for w in caught]
    report["stats"] = tpuc.stats()
    report["executables"] = EXECUTABLES
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
