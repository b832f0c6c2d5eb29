"""Outputs that are inputs or views of inputs (python/tpuc/input_views.py): a training forward
returns the weights it saves, and views of them, as PyTorch does (no copy per call), and the
backward takes a saved transposed weight in its storage order. Gradients must match eager's,
and what eager aliases stays aliased."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn


class TiedLM(nn.Module):
    """An embedding whose transpose is the output projection (GPT-2's LM head), plus a linear
    layer: the forward saves the weights and the transposed embedding for the backward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        h = torch.tanh(self.proj(self.emb(ids)))
        return h @ self.emb.weight.t()


def _grads(model, ids, compiled: bool):
    m = copy.deepcopy(model)
    fn = torch.compile(m, backend="tpu") if compiled else m
    for _ in range(2):
        m.zero_grad()
        out = fn(ids)
        out.square().mean().backward()
    return out.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


def test_saved_weights_and_their_views_match_eager(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 50, (2, 7))
    torch._dynamo.reset()
    monkeypatch.setenv("TPUC_DUMP_DIR", str(tmp_path))
    got_out, got = _grads(model, ids, compiled=True)
    monkeypatch.delenv("TPUC_DUMP_DIR")
    want_out, want = _grads(model, ids, compiled=False)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    # The compiled forward returns no parameter (primals_*) and no view of one: they left its
    # outputs and are made from the inputs at call time.
    (fx,) = [d / "fx_graph.txt" for d in tmp_path.iterdir() if d.name.endswith("forward_static")]
    ret = next(line for line in fx.read_text().splitlines() if line.strip().startswith("return ("))
    assert "primals" not in ret and "permute" not in ret, ret


def test_input_returned_and_viewed():
    """A graph returning its input and a transposed view of it: eager's aliasing is kept (the
    view shares the input's memory), values and gradients equal."""

    def f(x, w):
        y = x @ w
        return x, w.t(), y.relu().sum()

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    torch._dynamo.reset()
    a, wt, loss = torch.compile(f, backend="tpu")(x, w)
    loss.backward()
    assert torch.equal(a, x) and torch.equal(wt, w.t())
    assert wt.data_ptr() == w.data_ptr()  # a view, as eager returns
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w)[2].backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_in_place_update_before_backward_raises_as_in_eager():
    """A saved weight changed in place before the backward: eager refuses (the saved tensor's
    version moved); so does the compiled step, whose saved weight is the parameter itself."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: lin(x).tanh().sum(), backend="tpu")
    fn(x).backward()  # compiled and working
    loss = fn(x)
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_input_written_by_the_graph_is_not_replayed():
    """An input the graph mutates (in place through a view) and also returns a view of: the
    view must show what eager shows."""

    def f(x, w):
        w[:, :1].mul_(2.0)
        return (x * w).sum(), w.t()

    x = torch.randn(3, 4)
    w1, w2 = torch.randn(3, 4), None
    w2 = w1.clone()
    torch._dynamo.reset()
    got = torch.compile(f, backend="tpu")(x, w1)
    want = f(x, w2)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(w1, w2)
