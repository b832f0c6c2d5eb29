#!/usr/bin/env python
"""Per-step time of the small whole training steps of docs/training.md (an MLP and a CNN with
BatchNorm; SGD with momentum and AdamW) with the gradients cleared at the start of the step
(kept in p.grad after it: outputs of the program) or at the end (after opt.step(): none leave
the program), on the CPU plugin, or with TPUC_DEBUG=discrete_device as a device with memory of
its own (written state donated). Prints one RESULT line of {case: median us per step, programs
per step}. Run it for two trees side by side (PYTHONPATH) to compare: ratios only on a shared
host.

    PYTHONPATH=python .venv/bin/python bench/bench_step_writes.py [--steps 60]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import tpuc


def _mlp():
    return (
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)),
        (16, 32),
        (16, 8),
    )


def _cnn():
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 4),
    )
    return m, (4, 3, 16, 16), (4, 4)


OPTS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def case(model_name, opt_name, where, steps):
    torch.manual_seed(0)
    model, xs, ys = (_mlp if model_name == "mlp" else _cnn)()
    opt = OPTS[opt_name](model.parameters())

    def step(x, y):
        if where == "start":
            opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if where == "end":
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    x, y = torch.randn(*xs), torch.randn(*ys)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="tpu")
    for _ in range(5):
        compiled(x, y)
    tpuc.reset_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        compiled(x, y)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, tpuc.stats()["executions"] / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for model_name in ("mlp", "cnn"):
        for opt_name in OPTS:
            for where in ("start", "end"):
                us, programs = case(model_name, opt_name, where, a.steps)
                key = f"{model_name}/{opt_name}/zero_grad@{where}"
                out[key] = [round(us, 1), programs]
                print(f"{key:36s} {us:9.1f} us  {programs:.0f} programs/step", flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
