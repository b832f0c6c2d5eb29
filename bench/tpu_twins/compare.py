#!/usr/bin/env python
"""XLA:TPU's view of a tpuc graph against the same network written in JAX, with no TPU: both are
compiled for a TPU topology through libtpu's compile-only client, and their compile seconds and
XLA cost analysis (flops, bytes accessed, transcendentals) are printed side by side.

Needs a python with `jax[tpu]==0.10.2` (Python 3.11 here; separate from the project's venv: it is a
measuring tool, not a dependency):
    python3 -m venv ../jaxtpu && ../jaxtpu/bin/pip install "jax[tpu]==0.10.2"
    TPU_SKIP_MDS_QUERY=1 ../jaxtpu/bin/python compare.py --twin gpt2 --dump DIR [--topology v5e:2x2]
        [--precision highest]
DIR: a tpuc dump folder (or one graph folder) holding stablehlo.mlir files (`options={"dump_dir": ...}`);
every graph found is compiled, and the sums are compared with the twin (resnet18: `--train` for the
training twin, against the forward + backward graphs; `--split`: also the training twin as two
programs, forward and backward, as tpuc's are).
"""

import argparse
import glob
import json
import os
import re
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--twin", required=True, choices=["gpt2", "resnet18", "cnn"])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--train", action="store_true")
    # The twin's f32 matmul/convolution precision (jax.default_matmul_precision: "highest",
    # "default", ...); unset: JAX's default (one bf16 pass on a TPU). tpuc's modules carry their
    # own (PyTorch's float32 matmul precision, "highest" unless set).
    ap.add_argument("--precision", default=None)
    # Also the training twin as two programs (forward with its residuals, backward), as tpuc's
    # training step is: what splitting one gradient into two executables costs by itself.
    ap.add_argument("--split", action="store_true")
    a = ap.parse_args()
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
    dev = topo.devices[0]
    twin = __import__(a.twin)
    fn, args = twin.build(SingleDeviceSharding(dev), **({"train": True} if a.train else {}))
    t = time.time()
    if a.precision:
        with jax.default_matmul_precision(a.precision):
            lowered = jax.jit(fn).lower(*args)
    else:
        lowered = jax.jit(fn).lower(*args)
    c = lowered.compile()
    ref = {"seconds": time.time() - t, **{k: v for k, v in c.cost_analysis().items() if "{" not in k}}
    split = None
    if a.split:
        split = {"seconds": 0.0, "flops": 0.0, "bytes accessed": 0.0, "transcendentals": 0.0, "graphs": 0}
        split["per_graph_bytes"] = []
        for f, f_args in twin.build_split(SingleDeviceSharding(dev)):
            t = time.time()
            if a.precision:
                with jax.default_matmul_precision(a.precision):
                    cs = jax.jit(f).lower(*f_args).compile()
            else:
                cs = jax.jit(f).lower(*f_args).compile()
            split["seconds"] += time.time() - t
            for k, v in cs.cost_analysis().items():
                if k in split:
                    split[k] += v
            split["per_graph_bytes"].append(cs.cost_analysis().get("bytes accessed"))
            split["graphs"] += 1
    got = compile_dump(topo, a.dump)
    print(f"{'':18s} {'tpuc':>14s} {'jax twin':>14s} {'ratio':>7s}")
    for k in ("seconds", "flops", "bytes accessed", "transcendentals"):
        r = got[k] / ref[k] if ref.get(k) else float("nan")
        print(f"{k:18s} {got[k]:14.4g} {ref.get(k, float('nan')):14.4g} {r:7.2f}")
    if split is not None:
        r = split["bytes accessed"] / ref["bytes accessed"]
        print(
            f"{'split twin bytes':18s} {split['bytes accessed']:14.4g} {ref['bytes accessed']:14.4g} {r:7.2f}"
        )
    print("RESULT " + json.dumps({"tpuc": got, "jax": ref, **({"jax_split": split} if split else {})}))


def compile_dump(topo, folder: str) -> dict:
    """Compiles every `stablehlo.mlir` under a tpuc dump `folder` for the topology `topo`: the
    sums of their compile seconds and cost analysis, and the number of graphs."""
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    from jaxlib import _jax

    got = {"seconds": 0.0, "flops": 0.0, "bytes accessed": 0.0, "transcendentals": 0.0, "graphs": 0}
    client = topo.devices[0].client
    for path in sorted(glob.glob(os.path.join(folder, "**", "stablehlo.mlir"), recursive=True)):
        text = open(path).read()
        m = re.search(r"mhlo.num_partitions = (\d+)", text)
        n = int(m.group(1)) if m else 1
        opts = xc.CompileOptions()
        if n > 1:
            ebo = opts.executable_build_options
            ebo.num_partitions, ebo.num_replicas, ebo.use_spmd_partitioning = n, 1, True
            ebo.device_assignment = xc.DeviceAssignment.create(np.arange(n).reshape(1, n))
        t = time.time()
        with mlir.make_ir_context():
            exe = client.compile(
                ir.Module.parse(text),
                executable_devices=_jax.DeviceList(tuple(topo.devices[:n])),
                compile_options=opts,
            )
        got["seconds"] += time.time() - t
        for k, v in exe.cost_analysis().items():
            if k in got:
                got[k] += v
        got["graphs"] += 1
    return got


if __name__ == "__main__":
    main()
