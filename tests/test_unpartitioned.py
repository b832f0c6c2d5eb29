"""On the CPU plugin a graph whose tensors are all small (at most 2^18 elements) is compiled with
its loop fusions unpartitioned (run on the calling thread, not split over XLA's pool); larger
graphs keep XLA's partitions; `TPUC_UNPARTITIONED_MAX` sets the bound (0: never). Read from
XLA's optimized HLO, where a partitioned fusion carries a non-empty `outer_dimension_partitions`. The compiling
thread's CPU affinity is restored after."""

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
import os, pathlib, re, sys, torch, tpuc
import torch.nn.functional as F
before = os.sched_getaffinity(0)
def small(x):
    return torch.exp(torch.sin(x) * 2.0) + x
def large(x):
    return torch.exp(torch.sin(x) * 2.0) + x
dump = pathlib.Path(sys.argv[1])
with torch.no_grad():
    for name, fn, x in (("small", small, torch.randn(512, 512)), ("large", large, torch.randn(700, 700))):
        out = torch.compile(fn, backend="tpu", options={"cache_dir": None})(x)
        torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)
assert os.sched_getaffinity(0) == before, (os.sched_getaffinity(0), before)
# XLA's own dump, in compile order (tpuc's optimized_hlo.txt leaves out backend configs).
hlos = sorted(dump.glob("module_*.cpu_after_optimizations.txt"))
assert len(hlos) == 2, hlos
for name, hlo in zip(("small", "large"), hlos):
    # Non-empty: YNNPACK fusions (a convolution) carry an empty list either way.
    print(name, re.search(r'outer_dimension_partitions"?[:=]\s*\["?\d', hlo.read_text()) is not None)
"""


def _partitioned(tmp_path, **env) -> dict[str, bool]:
    child_env = {k: v for k, v in os.environ.items() if k != "TPUC_UNPARTITIONED_MAX"} | env
    child_env["XLA_FLAGS"] = f"--xla_dump_to={tmp_path}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {name: flag == "True" for name, flag in (line.split() for line in out.stdout.split("\n") if line)}


def test_small_graphs_run_unpartitioned_and_large_ones_keep_xlas_partitions(tmp_path):
    assert _partitioned(tmp_path) == {"small": False, "large": True}


def test_tpuc_unpartitioned_max_zero_keeps_every_partition(tmp_path):
    assert _partitioned(tmp_path, TPUC_UNPARTITIONED_MAX="0") == {"small": True, "large": True}
