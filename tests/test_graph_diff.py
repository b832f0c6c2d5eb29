"""tpuc.graph_diff (`tpuc graph-diff`), the per-graph and per-op comparison of tpuc with eager
(issue 40): its errors are the graph's and the op's own, with views and in-place ops in the graph."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from tpuc import cli, graph_diff


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


def test_the_command_compares_a_factorys_model_and_locates_a_call(tmp_path, monkeypatch, capsys):
    (tmp_path / "gd_factory.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))\n"
        "    return m.eval(), (torch.randn(4, 64),)\n"
    )
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    # --threshold -1: every call is beyond it, so the first one is located, op by op.
    assert cli.main(["graph-diff", "gd_factory:build", "--locate", "--threshold", "-1", "--show", "50"]) == 0
    out = capsys.readouterr().out
    assert "final: 1 outputs, worst error" in out
    assert "graph 0:" in out and "locating graph 0 call 0" in out
    # The table has the model's three ops, each within float32 rounding of eager's.
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+ ", line) and "float32" in line]
    assert any("linear" in r for r in rows) and any("gelu" in r for r in rows), out
    local = [float(re.search(r"float32\s+(\S+)", r).group(1)) for r in rows]
    assert len(local) >= 3 and max(local) < 1e-5, out
    assert cli.main(["graph-diff", "gd_factory"]) == 2  # no FACTORY
