#!/usr/bin/env python
"""How XLA:TPU's compile time of GPT-2 124M grows with its depth, and what compiling its block once
can save: the JAX twin unrolled (12 blocks), the twin with `jax.lax.scan` over stacked blocks (JAX's
scan over layers, what PyTorch/XLA's `scan_layers` does), one block alone and the rest (embedding
and head) alone, and optionally tpuc's dumps of the same model unmarked and with its blocks marked
as compile regions, all compiled for one TPU topology by the same libtpu, no TPU needed.

Run with the jax[tpu] Python (see compare.py):
    TPU_SKIP_MDS_QUERY=1 ../jaxtpu/bin/python depth.py [--precision highest] [--reps 2]
        [--tpuc unmarked=DIR --tpuc marked=DIR]
Each figure is the best of --reps compiles (JAX's cache is per process and keyed by the program:
each rep jits a fresh function object; tpuc's modules are compiled from their text each time).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5e:2x2")
    # jax.default_matmul_precision for the twin: "highest" is what tpuc's modules carry under
    # PyTorch's default float32 matmul precision; unset: JAX's default (one bf16 pass on a TPU).
    ap.add_argument("--precision", default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tpuc", action="append", default=[], metavar="NAME=DIR", help="a tpuc dump folder")
    a = ap.parse_args()
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import gpt2
    from compare import compile_dump

    topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
    sharding = SingleDeviceSharding(topo.devices[0])
    if a.precision:
        jax.config.update("jax_default_matmul_precision", a.precision)
    parts = gpt2.build_parts(sharding)
    cases = {
        "jax unrolled": lambda: gpt2.build(sharding),
        "jax scan": lambda: gpt2.build(sharding, scan=True),
        "jax one block": lambda: parts["block"],
        "jax rest (no blocks)": lambda: parts["rest"],
    }
    result = {}
    for name, make in cases.items():
        best = None
        for _ in range(a.reps):
            fn, args = make()
            t = time.time()
            jax.jit(lambda *xs, fn=fn: fn(*xs)).lower(*args).compile()
            best = min(best or 1e9, time.time() - t)
        result[name] = best
        print(f"{name:24s} {best:7.2f} s", flush=True)
    for spec in a.tpuc:
        name, folder = spec.split("=", 1)
        best = min(compile_dump(topo, folder)["seconds"] for _ in range(a.reps))
        result[f"tpuc {name}"] = best
        print(f"{'tpuc ' + name:24s} {best:7.2f} s", flush=True)
    print("RESULT " + json.dumps({"precision": a.precision or "default", "seconds": result}))


if __name__ == "__main__":
    main()
