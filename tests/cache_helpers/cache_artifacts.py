"""One process that compiles a model with `backend="tpu"`, runs a training step, checks it against
eager PyTorch, and either saves PyTorch's portable cache artifacts
(`torch.compiler.save_cache_artifacts()`) or loads them first (`load_cache_artifacts()`). Prints
a JSON report as its last line.

    python cache_artifacts.py save|load --path FILE [--regions]

`--regions`: the model's blocks are marked as compile regions, each compiled once as an executable
of its own (option `regions="executables"`; the CPU plugin's default inlines them).
The caller sets TPUC_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (AOTAutograd's cache) per process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for models.py

import torch  # noqa: E402
from models import PreLNBlock  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402


class MarkedBlock(PreLNBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x):
        return super().forward(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["save", "load"])
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--regions", action="store_true")
    args = p.parse_args()

    loaded = None
    if args.action == "load":
        info = torch.compiler.load_cache_artifacts(args.path.read_bytes())
        loaded = {k: len(v) for k, v in info.artifacts.items()} if info is not None else None

    import tpuc

    torch.manual_seed(0)
    block = MarkedBlock if args.regions else PreLNBlock
    model = torch.nn.Sequential(*(block() for _ in range(4)), torch.nn.Linear(64, 5))
    x = torch.randn(2, 17, 64)
    tpuc.reset_stats()
    options = {"regions": "executables"} if args.regions else None
    out = torch.compile(model, backend="tpu", options=options)(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = tpuc.stats()

    model.zero_grad()
    ref = model(x)
    ref.square().mean().backward()
    err = max(
        float((out - ref).abs().max()),
        *(float((g - p.grad).abs().max()) for g, p in zip(grads, model.parameters(), strict=True)),
    )
    report = {
        "max_abs_err": err,
        "out_sum": float(out.detach().double().sum()),
        "stats": {
            k: stats[k] for k in ("xla_compiles", "cache_hits_disk", "fallback_ops", "regions_compiled")
        },
        "aot_autograd": dict(counters["aot_autograd"]),
        "loaded": loaded,
    }
    if args.action == "save":
        saved = torch.compiler.save_cache_artifacts()
        report["saved"] = None if saved is None else {k: len(v) for k, v in saved[1].artifacts.items()}
        if saved is not None:
            args.path.write_bytes(saved[0])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
