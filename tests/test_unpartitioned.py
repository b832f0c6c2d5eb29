"""On the CPU plugin a graph whose tensors are all small (at most 2^18 elements), or a graph
without convolutions whose loop results (not inputs, views or products) have at most 32 times
that, is compiled with its loop fusions unpartitioned (run on the calling thread, not split over
XLA's pool); other graphs keep XLA's partitions; `tpuc._native.set_unpartitioned_max` sets the
bound (0: never). Read from
XLA's optimized HLO, where a partitioned fusion carries a non-empty `outer_dimension_partitions`. The compiling
thread's CPU affinity is restored after, and given to the threads the plugin started meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="XLA only partitions fusions where the process may run on two CPUs or more",
)

CHILD = r"""
import json, os, pathlib, re, sys, torch, tpuc
import torch.nn.functional as F
if len(sys.argv) > 2:
    tpuc._native.set_unpartitioned_max(int(sys.argv[2]))
before = os.sched_getaffinity(0)
def small(x):
    return torch.exp(torch.sin(x) * 2.0) + x
def conv_free(x, w):
    # A transformer MLP's shape: the 3072-wide loop result (and the weight) above 2^18. Loops
    # of few flops per byte (XLA prices the others by its own thread count, unpinned).
    return torch.relu(x @ w) + 1.0
def conv_free_huge(x):
    return torch.exp(torch.sin(x) * 2.0) + x
def conv(x, w):
    return torch.relu(F.conv2d(x, w, padding=1)) * 2.0
def patch_conv_then_products(x, w, a, b):
    # A vision transformer's shape: one patch convolution, then four matrix products (measured
    # both ways from run to run on ViT-B/16: kept partitioned).
    t = F.conv2d(x, w, stride=4).flatten(2).transpose(1, 2)[0]
    for _ in range(2):
        t = torch.relu(t @ a) + 1.0
        t = t @ b
    return t
cases = (
    ("small", small, (torch.randn(512, 512),)),
    ("conv_free", conv_free, (torch.randn(256, 768), torch.randn(768, 3072))),
    ("conv_free_huge", conv_free_huge, (torch.randn(3000, 3000),)),
    ("conv", conv, (torch.randn(1, 8, 256, 256), torch.randn(8, 8, 3, 3))),
    ("patch_conv_then_products", patch_conv_then_products,
     (torch.randn(1, 3, 256, 256), torch.randn(64, 3, 4, 4), torch.randn(64, 256) / 8, torch.randn(256, 64) / 16)),
)
dump = pathlib.Path(sys.argv[1])
with torch.no_grad():
    for name, fn, args in cases:
        opts = {"cache_dir": None, "dump_dir": str(dump / "tpuc" / name)}
        out = torch.compile(fn, backend="tpu", options=opts)(*args)
        torch.testing.assert_close(out, fn(*args), rtol=1e-4, atol=1e-4)
assert os.sched_getaffinity(0) == before, (os.sched_getaffinity(0), before)
# Threads the plugin started during a pinned compile (XLA starts some pools lazily) got the
# compiling thread's affinity back, as every other thread has.
for task in pathlib.Path("/proc/self/task").iterdir():
    assert os.sched_getaffinity(int(task.name)) == before, (task.name, os.sched_getaffinity(int(task.name)))
# XLA's own dump, in compile order (the authority on what XLA compiled; tpuc's
# optimized_hlo.txt, printed from the optimized HloModuleProto, must show the same partitions).
hlos = sorted(dump.glob("module_*.cpu_after_optimizations.txt"))
# The plugin's known-answer check (conformance.py) may compile its programs first, when the
# runtime starts: the cases' modules are the last ones.
assert len(hlos) >= len(cases), hlos
hlos = hlos[-len(cases):]
for (name, _, _), hlo in zip(cases, hlos):
    # Non-empty: YNNPACK fusions (a convolution) carry an empty list either way.
    partitioned = re.search(r'outer_dimension_partitions"?[:=]\s*\["?\d', hlo.read_text()) is not None
    # tpuc's own dump says which way it compiled the graph.
    (meta,) = (dump / "tpuc" / name).rglob("meta.json")
    assert json.loads(meta.read_text())["unpartitioned"] == (not partitioned), (name, partitioned)
    (ours,) = (dump / "tpuc" / name).rglob("optimized_hlo.txt")
    shown = re.search(r'outer_dimension_partitions"?[:=]\s*\["?\d', ours.read_text()) is not None
    assert shown == partitioned, (name, partitioned)
    print(name, partitioned)
"""


def _partitioned(tmp_path, *unpartitioned_max: int) -> dict[str, bool]:
    child_env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), *map(str, unpartitioned_max)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {name: flag == "True" for name, flag in (line.split() for line in out.stdout.split("\n") if line)}


def test_small_and_conv_free_graphs_run_unpartitioned_large_ones_keep_partitions(tmp_path):
    assert _partitioned(tmp_path) == {
        "small": False,
        "conv_free": False,
        "conv_free_huge": True,
        "conv": True,
        "patch_conv_then_products": True,
    }


def test_unpartitioned_max_zero_keeps_every_partition(tmp_path):
    assert _partitioned(tmp_path, 0) == {
        "small": True,
        "conv_free": True,
        "conv_free_huge": True,
        "conv": True,
        "patch_conv_then_products": True,
    }
