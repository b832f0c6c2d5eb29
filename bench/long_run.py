"""Long run: 100,000 calls of a small compiled model with changing inputs; reports resident memory
over time, live PJRT objects (buffers, events, executables: counted by the runtime) and open file
descriptors, and checks that memory settles.

    .venv/bin/python bench/long_run.py [--calls 100000] [--out bench/results/long_run.json]

Exit status 1 when RSS grows by 1% or more over the last half of the calls, or live PJRT objects
or file descriptors differ between the middle and the end."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TPUC_CACHE_DIR", tempfile.mkdtemp(prefix="tpuc-long-run-"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tpuc  # noqa: E402
from tpuc import _native  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=20, help="RSS samples over the run")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "long_run.json"))
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32)).eval()
    f = torch.compile(model, backend="tpu", dynamic=False, options={"fallback": "error"})
    shapes = [(8, 32), (16, 32), (4, 32)]
    every = max(1, args.calls // args.samples)
    samples = []
    t0 = time.perf_counter()
    mid = None
    with torch.no_grad():
        for k in range(args.calls):
            x = torch.randn(shapes[k % len(shapes)])
            out = f(x)
            if k % 10_000 == 0:
                torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            if (k + 1) % every == 0 or k + 1 == args.calls:
                del out
                gc.collect()
                sample = {
                    "calls": k + 1,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "rss_mb": round(rss_bytes() / 1e6, 3),
                    "fds": open_fds(),
                    **_native.live_objects(),
                }
                samples.append(sample)
                if mid is None and k + 1 >= args.calls // 2:
                    mid = sample
                print(json.dumps(sample), flush=True)
    end = samples[-1]
    growth = (end["rss_mb"] - mid["rss_mb"]) / mid["rss_mb"]
    live_keys = ("buffers", "events", "executables", "fds")
    report = {
        "calls": args.calls,
        "seconds": end["seconds"],
        "us_per_call": round(end["seconds"] / args.calls * 1e6, 1),
        "rss_first_sample_mb": samples[0]["rss_mb"],
        "rss_mid_mb": mid["rss_mb"],
        "rss_end_mb": end["rss_mb"],
        "rss_growth_last_half_pct": round(100 * growth, 4),
        "live_mid": {k: mid[k] for k in live_keys},
        "live_end": {k: end[k] for k in live_keys},
        "stats": {k: v for k, v in tpuc.stats().items() if k in ("xla_compiles", "executions")},
        "samples": samples,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_avg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    ok = growth < 0.01 and all(mid[k] == end[k] for k in live_keys)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
