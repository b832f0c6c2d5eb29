#!/usr/bin/env python
"""Memory per chip of a whole training step compiled for a TPU target (compile-only, no TPU):
torchvision's ResNet-18 (10 classes, batch 2 at 3x64x64, the shape of tpu_twins/resnet18.py's
`--step` twin) with SGD momentum, one eager step first so that the momentum buffers exist (the
steady-state step). Prints XLA:TPU's memory analysis of the step's executable: arguments, outputs,
aliased (outputs written into argument buffers), temporaries, code, and the per-chip footprint
(arguments + outputs - aliased + temporaries + code), and the `tf.aliasing_output` count of the
module. The dump folder (`--dump`) holds the module for tpu_twins/compare.py `--step`.

    PYTHONPATH=python .venv/bin/python bench/bench_step_memory.py [--dump DIR] [--target tpu:v5e:2x2]
        [--zero-grad start|end] [--precision default]  (default: highest; "default" is the twin's one bf16 pass)
"""

import argparse
import glob
import json
import os
import tempfile

import torch
import torchvision

import tpuc
from tpuc import targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    ap.add_argument("--target", default="tpu:v5e:2x2")
    ap.add_argument("--loss", default="sum", choices=["sum", "ce"])
    ap.add_argument("--precision", default="highest", help="f32 product precision (JAX twin: default)")
    # Where the step clears the gradients: "start" keeps them in p.grad after the step (outputs of
    # the program), "end" (after opt.step()) leaves p.grad None, so the program returns none.
    ap.add_argument("--zero-grad", default="start", choices=["start", "end"])
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 64, 64)
    y = torch.randint(0, 10, (2,))

    def step(x, y):
        if a.zero_grad == "start":
            opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = out.sum() if a.loss == "sum" else torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        if a.zero_grad == "end":
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    step(x, y)  # eager: the momentum buffers exist from here on
    tpuc.reset_stats()
    dump = a.dump or tempfile.mkdtemp()
    cache = tempfile.mkdtemp()
    compiled = torch.compile(
        step,
        backend="tpu",
        options={"target": a.target, "cache_dir": cache, "dump_dir": dump, "precision": a.precision},
    )
    try:
        compiled(x, y)
    except targets.TargetUnavailableError:
        pass
    print(f"programs compiled: {tpuc.stats()['graphs_compiled']}")
    for meta in sorted(glob.glob(os.path.join(dump, "**", "meta.json"), recursive=True)):
        m = json.load(open(meta))
        text = open(meta.replace("meta.json", "stablehlo.mlir")).read()
        h = m["hbm_bytes"]
        row = {k: h[k] for k in ("arguments", "outputs", "aliased", "temporaries", "code")}
        row["per_chip"] = m["footprint_bytes"]
        row["aliasing_attrs"] = text.count("tf.aliasing_output")
        row["bytes_accessed"] = m["cost"].get("bytes accessed")
        print(m["graph"], json.dumps(row))
        print("RESULT " + json.dumps({"graph": m["graph"], **row}))


if __name__ == "__main__":
    main()
