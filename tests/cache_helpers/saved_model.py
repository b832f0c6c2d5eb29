"""One process that saves (`tpuc.save_compiled`) or loads (`tpuc.load_compiled`) a compiled
reference model, checks it against eager PyTorch and prints a JSON report as its last line.

    python saved_model.py save|load --path FILE --cache-dir DIR [--model preln] [--seed 0] [--train]
        [--batch 2]

`--seed`: the seed of the model's weights (a load may use other weights than the save);
`--train`: grad enabled, the loss's parameter gradients are checked too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for models.py

import torch  # noqa: E402
from models import make  # noqa: E402

import tpuc  # noqa: E402
from tpuc import backend  # noqa: E402

# Calls of tpuc's Dynamo backend (each follows a Dynamo trace and runs AOTAutograd's trace).
TRACES = {"backend": 0}
_compile = backend._compile


def _counted(*a, **k):
    TRACES["backend"] += 1
    return _compile(*a, **k)


backend._compile = _counted


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["save", "load"])
    p.add_argument("--path", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--model", default="preln")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--train", action="store_true")
    args = p.parse_args()

    model, (x,) = make(args.model, batch=args.batch, seed=args.seed)
    if args.train:
        model.train()
    torch.set_grad_enabled(args.train)
    t0 = time.perf_counter()
    if args.action == "save":
        fn = tpuc.save_compiled(
            model, args.path, (x,), options={"cache_dir": args.cache_dir, "fallback": "error"}
        )
    else:
        fn = tpuc.load_compiled(args.path, model, options={"cache_dir": args.cache_dir})
    out = fn(x)
    first_call = time.perf_counter() - t0
    report = {
        "first_call_seconds": first_call,
        "backend_calls": TRACES["backend"],
        "errors": [],
    }
    expected = model(x)
    report["max_abs_err"] = (out - expected).abs().max().item()
    if report["max_abs_err"] > 1e-5:
        report["errors"].append(f"output differs from eager by {report['max_abs_err']}")
    if args.train:
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        eager = torch.autograd.grad(expected.square().mean(), list(model.parameters()))
        report["max_grad_err"] = max((a - b).abs().max().item() for a, b in zip(grads, eager, strict=True))
        if report["max_grad_err"] > 1e-5:
            report["errors"].append(f"gradients differ from eager by {report['max_grad_err']}")
    try:  # another batch size: the saved function is for the traced shapes only
        fn(torch.cat([x, x]))
        report["other_shape"] = "ran"
    except RuntimeError as e:
        report["other_shape"] = str(e)
    report["stats"] = tpuc.stats()
    report["ok"] = not report["errors"]
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
