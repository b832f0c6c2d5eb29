"""Data-parallel training and tensor-parallel inference on 4 CPU devices.

The CPU PJRT plugin exposes as many devices as a mesh needs (or TPUC_CPU_DEVICES); the same code
runs on a TPU slice or several GPUs with the plugin set to `tpu` / `cuda`.

    .venv/bin/python examples/sharding.py

1. Data parallel: a small MLP classifier trains for a few SGD steps with the batch split over 4
   devices; parameters are replicated, XLA all-reduces the gradients. Each step's loss is checked
   against the same model trained eagerly.
2. Tensor parallel: a transformer-style MLP block (up projection, GELU, down projection) runs with
   the up projection split by columns and the down projection by rows over a 2x2 mesh's `model`
   axis (the `data` axis splits the batch only under data_parallel/fsdp; here it holds copies).
It exits non-zero on any mismatch.
"""

import copy
import sys

import torch
from torch import nn

import tpuc


def data_parallel_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    eager = copy.deepcopy(model)
    mesh = {"shape": [4], "axes": ["data"]}
    step = torch.compile(
        lambda x, y: nn.functional.cross_entropy(model(x), y),
        backend="tpu",
        options={"mesh": mesh, "sharding": "data_parallel"},
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for i in range(5):
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))  # 16 rows per device
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = nn.functional.cross_entropy(eager(x), y)
        ref.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
        print(f"data parallel step {i}: loss {loss.item():.4f} (eager {ref.item():.4f})")


def tensor_parallel_inference() -> None:
    torch.manual_seed(1)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    mesh = {"shape": [2, 2], "axes": ["data", "model"]}
    compiled = torch.compile(block, backend="tpu", options={"mesh": mesh, "sharding": "tensor_parallel"})
    before = tpuc.resident_bytes() + [0] * 4  # what the training example's graphs still hold
    with torch.no_grad():
        for _ in range(3):  # parameters stay resident on the devices after the second call
            x = torch.randn(8, 64)
            out = compiled(x)
            torch.testing.assert_close(out, block(x), rtol=1e-4, atol=1e-5)
    per_device = [b - a for a, b in zip(before, tpuc.resident_bytes()[:4], strict=False)]
    full = sum(p.numel() * 4 for p in block.parameters())
    print(
        f"tensor parallel: output matches eager; parameter bytes per device {per_device} "
        f"of {full} ({per_device[0] / full:.2f} of the model: both projections halved, the last bias whole)"
    )


if __name__ == "__main__":
    try:
        data_parallel_training()
        tensor_parallel_inference()
    except AssertionError as e:
        print(f"MISMATCH: {e}")
        sys.exit(1)
    print(tpuc.stats()["executions"], "executions through tpuc")
