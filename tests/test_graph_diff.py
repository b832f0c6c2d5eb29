"""bench/graph_diff.py, the per-graph and per-op comparison of tpuc with eager (issue 40): its
errors are the graph's and the op's own, with views and in-place ops in the graph."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import graph_diff  # noqa: E402


def _model(x, w, scale):
    y = F.conv2d(x, w, padding=1)
    y = y.relu_()  # in place: the probe must keep the conv's value, not the relu's
    z = y.new_zeros(y.shape[0], y.shape[1], y.shape[2] + 2, y.shape[3])
    z[:, :, 1:-1].copy_(y)  # a write through a view into a new tensor, as torchvision's batching
    z += scale
    return (z * 3).sum(1), y.amax()


def test_errors_are_each_graphs_and_each_ops_own():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 17, 64, generator=g)
    w = torch.randn(16, 8, 3, 3, generator=g)
    diff = graph_diff.GraphDiff(keep_above=-1)  # every call's inputs, for locate()
    torch._dynamo.reset()
    compiled = torch.compile(_model, backend=diff, dynamic=False)
    out = compiled(x, w, 0.5)
    ref = _model(x, w, 0.5)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    assert len(diff.graphs) == 1 and len(diff.sequence) == 1
    call = diff.sequence[0]
    assert len(call.errors) == 2 and call.worst < 1e-5, call.errors

    rows = diff.locate(call, show=0)
    by_op = {}
    for row in rows:
        by_op.setdefault(row[2].split(":")[1], []).append(row)
    # Every tensor op of the graph is there, and the exact ones (relu, the copy into a view, the
    # add and the scaling) have no local error: each compares tpuc's value right after the op
    # with the op on tpuc's own inputs, whatever in-place op comes later.
    assert {"conv2d", "relu_", "new_zeros", "copy_", "iadd", "mul", "sum", "amax"} <= set(by_op), sorted(
        by_op
    )
    for op in ("relu_", "new_zeros", "copy_", "iadd", "mul", "amax"):
        assert all(r[5] == 0.0 for r in by_op[op]), (op, by_op[op])
    conv = by_op["conv2d"][0]
    assert conv[5] < 1e-5 and conv[7] is not None and conv[8] < 1e-5, conv  # rounding, against float64 too


def test_rel_error_scales_by_the_reference_and_sees_mismatches():
    r = torch.tensor([1.0, -4.0, 2.0])
    assert graph_diff.rel_error(r, r.clone()) == 0.0
    assert graph_diff.rel_error(r, r + torch.tensor([0.0, 0.0, 0.25])) == 0.25 / 4  # exact in float32
    assert graph_diff.rel_error(r, r[:2]) == float("inf")
    assert graph_diff.rel_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == float("inf")
    assert graph_diff.rel_error(torch.tensor([float("nan")]), torch.tensor([float("nan")])) == 0.0
