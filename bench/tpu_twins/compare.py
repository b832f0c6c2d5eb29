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
programs, forward and backward, as tpuc's are; `--step`: one whole training step, the twin's
`build(step=True)` with its parameters and optimizer state donated, against tpuc's one program for
the whole step; `--layers N`: GPT-2's step twin with N blocks).

Also printed: memory per chip (arguments, outputs, aliased, temporaries, code; "memory" is
arguments + outputs - aliased + temporaries + code, summed over tpuc's graphs). With `--step`,
tpuc's dump should be of a step that clears its gradients at the end (`backward(); step();
zero_grad()`: no gradient outputs, as the twin; or pass `--grad-outputs` for one that keeps them).
"""

import argparse
import glob
import json
import os
import re
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


MEMORY = ("arguments", "outputs", "aliased", "temporaries", "code")


def memory(stats) -> dict:
    """Memory per chip of one executable, from XLA's CompiledMemoryStats."""
    m = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "code": stats.generated_code_size_in_bytes,
    }
    m["memory"] = m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]
    return m


def tree_bytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


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
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    # The step twin also returns its gradients, as tpuc's step does (eager's p.grad holds them):
    # the twin of the same outputs, to tell that difference from the rest.
    ap.add_argument("--grad-outputs", action="store_true")
    a = ap.parse_args()
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
    dev = topo.devices[0]
    twin = __import__(a.twin)
    kw = {"step": True} if a.step else ({"train": True} if a.train else {})
    if a.layers is not None:
        kw["layers"] = a.layers
    if a.grad_outputs:
        kw["grad_outputs"] = True
    fn, args = twin.build(SingleDeviceSharding(dev), **kw)
    donate = twin.DONATE if a.step else ()
    t = time.time()
    if a.precision:
        with jax.default_matmul_precision(a.precision):
            lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    else:
        lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    c = lowered.compile()
    ref = {"seconds": time.time() - t, **{k: v for k, v in c.cost_analysis().items() if "{" not in k}}
    ref.update(memory(c.memory_analysis()))
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
    if a.step:
        # The state the step writes (parameters, optimizer state, buffers): the twin's donated
        # arguments, what tpuc's step should alias too.
        got["written_state"] = sum(tree_bytes(args[i]) for i in donate)
    print(f"{'':40s} {'tpuc':>14s} {'jax twin':>14s} {'ratio':>7s}")
    keys = ("seconds", "flops", "bytes accessed", "transcendentals", "memory", *MEMORY)
    for k in keys:
        r = got[k] / ref[k] if ref.get(k) else float("nan")
        print(f"{k:40s} {got[k]:14.4g} {ref.get(k, float('nan')):14.4g} {r:7.2f}")
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
    got.update(dict.fromkeys((*MEMORY, "memory"), 0))
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
        for k, v in memory(exe.get_compiled_memory_stats()).items():
            got[k] += v
        for k, v in exe.cost_analysis().items():
            if k in got:
                got[k] += v
        got["graphs"] += 1
    return got


if __name__ == "__main__":
    main()
