#!/usr/bin/env python
"""Compile seconds and XLA:TPU cost of StableHLO modules and JAX twins, side by side in one
process (compile-only, no TPU): what bisecting a slow compile needs (compile a module, then the
same module with a piece removed or changed). Same python as compare.py (`jax[tpu]==0.10.2`).

    ../jaxtpu/bin/python compile_modules.py [--repeat 1] ITEM...

ITEM: a `stablehlo.mlir` path (a tpuc dump's, or any module), or `twin:NAME[:PRECISION]` (the
gradient of twin NAME, e.g. `twin:cnn:highest`; PRECISION as jax.default_matmul_precision takes
it, none: JAX's default). Prints one line per item and a JSON line (RESULT) with every number.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("items", nargs="+")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    import jax
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding
    from jaxlib import _jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
    dev = topo.devices[0]

    def compile_item(item):
        if item.startswith("twin:"):
            name, _, precision = item[5:].partition(":")
            fn, args = __import__(name).build(SingleDeviceSharding(dev), train=True)
            t = time.time()
            if precision:
                with jax.default_matmul_precision(precision):
                    exe = jax.jit(fn).lower(*args).compile()
            else:
                exe = jax.jit(fn).lower(*args).compile()
            return time.time() - t, exe.cost_analysis()
        text = open(item).read()
        t = time.time()
        with mlir.make_ir_context():
            exe = dev.client.compile(
                ir.Module.parse(text),
                executable_devices=_jax.DeviceList((dev,)),
                compile_options=xc.CompileOptions(),
            )
        return time.time() - t, exe.cost_analysis()

    results = []
    for _ in range(a.repeat):
        for item in a.items:
            seconds, cost = compile_item(item)
            r = {"item": item, "seconds": seconds, **{k: cost.get(k) for k in ("flops", "bytes accessed")}}
            results.append(r)
            print(
                f"{seconds:8.2f} s  {r['bytes accessed'] or 0:12.4g} B  {r['flops'] or 0:12.4g} flops  {item}",
                flush=True,
            )
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
