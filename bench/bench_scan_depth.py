"""XLA:TPU compile seconds of L transformer-style blocks (layer norm, one-head attention, GELU MLP;
D=768, T=128) for a TPU target, compile-only: the blocks scanned over weights stacked along a
leading dim (`torch._higher_order_ops.scan`: one `stablehlo.while`, docs/control-flow.md) against
the same blocks unrolled in Python (one copy of the block per layer in the program).

    .venv/bin/python bench/bench_scan_depth.py --layers 2 12 --target tpu:v5e:1x1

Prints one line per (L, form): tpuc.stats()'s XLA compile seconds and the wall time of the
precompile (trace + lower + compile). Each compile gets an empty cache. On a shared machine
compare the ratios of one run."""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch._higher_order_ops import scan

import tpuc

D, T = 768, 128


def block(x, w1, w2, wq):
    h = torch.nn.functional.layer_norm(x, (D,))
    x = x + torch.softmax((h @ wq) @ h.transpose(-1, -2) / D**0.5, -1) @ h
    h = torch.nn.functional.layer_norm(x, (D,))
    return x + torch.nn.functional.gelu(h @ w1) @ w2


def scanned(x, w1s, w2s, wqs):
    return scan(lambda x, w: (block(x, *w), x.sum()), x, (w1s, w2s, wqs))[0]


def unrolled(x, w1s, w2s, wqs):
    for i in range(w1s.shape[0]):
        x = block(x, w1s[i], w2s[i], wqs[i])
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    p.add_argument("--target", default="tpu:v5e:1x1")
    args = p.parse_args()
    for layers in args.layers:
        inputs = (
            torch.randn(T, D),
            torch.randn(layers, D, 4 * D) / 30,
            torch.randn(layers, 4 * D, D) / 60,
            torch.randn(layers, D, D) / 30,
        )
        for name, fn in (("unrolled", unrolled), ("scan", scanned)):
            torch._dynamo.reset()
            tpuc.reset_stats()
            t0 = time.perf_counter()
            options = {"target": args.target, "cache_dir": tempfile.mkdtemp(), "fallback": "error"}
            tpuc.precompile(fn, inputs, options=options)
            wall = time.perf_counter() - t0
            print(
                f"L={layers:3d} {name:9s} XLA compile {tpuc.stats()['compile_seconds']:7.2f} s, precompile {wall:7.2f} s"
            )


if __name__ == "__main__":
    main()
