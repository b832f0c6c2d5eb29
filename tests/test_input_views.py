"""Outputs that are inputs or views of inputs (python/tpuc/input_views.py): a training forward
returns the weights it saves, and views of them, as PyTorch does (no copy per call), and the
backward takes a saved transposed weight in its storage order. Gradients must match eager's,
and what eager aliases stays aliased."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

# Every test here runs again under TPUC_DEBUG=discrete_device: outputs made from inputs at call
# time, and saved weights, cross the device boundary.
pytestmark = pytest.mark.discrete_device


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
    # The compiled forward returns no view of a parameter (they left its outputs and are made
    # from the inputs at call time), and its executable has no output for a parameter it
    # returns as it came (the caller's tensor is the result).
    (folder,) = [d for d in tmp_path.iterdir() if d.name.endswith("forward_static")]
    ret = _returned(folder)
    assert not any("permute" in r for r in ret), ret
    unchanged = [r for r in ret if r.startswith("primals")]
    assert unchanged, ret
    assert len(_executable_outputs(folder)) == len(ret) - len(unchanged)


def _returned(folder) -> list[str]:
    """The names a dumped graph's FX `return` lists."""
    fx = (folder / "fx_graph.txt").read_text()
    ret = next(line for line in fx.splitlines() if line.strip().startswith("return ("))
    return [r.strip() for r in ret.strip()[len("return (") : -1].split(",") if r.strip()]


def _executable_outputs(folder) -> list:
    return json.loads((folder / "meta.json").read_text())["outputs"]


class SmallConvNet(nn.Module):
    """Convolutions, batch norm, ReLU, max pooling and a classifier: the forward saves every
    weight as it came (no view of it) for the backward."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def _saved_by(fn, *args) -> tuple:
    """`fn(*args)` and the tensors autograd saved for its backward, as they were saved."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_saved_parameters_are_the_parameters_themselves(tmp_path, monkeypatch):
    """A training forward that returns parameters for its backward: the saved tensors are the
    parameter objects, where aot_eager's are (Inductor's code returns its inputs too), and the
    executable has no output for them (nothing copies them)."""
    torch.manual_seed(0)
    model, x = SmallConvNet(), torch.randn(2, 3, 8, 8)
    # Saved as they came by both (the classifier's weight is saved transposed by tpuc: a view,
    # test_saved_weights_and_their_views_match_eager).
    weights = [model.conv1.weight, model.bn.weight, model.conv2.weight]
    same = {}
    for backend in ("aot_eager", "tpu"):
        torch._dynamo.reset()
        if backend == "tpu":
            monkeypatch.setenv("TPUC_DUMP_DIR", str(tmp_path))
        fn = torch.compile(model, backend=backend)
        _out, saved = _saved_by(fn, x)
        same[backend] = [any(t is w for t in saved) for w in weights]
    monkeypatch.delenv("TPUC_DUMP_DIR")
    assert same["tpu"] == same["aot_eager"] == [True] * 3, same
    (folder,) = [d for d in tmp_path.iterdir() if d.name.endswith("forward_static")]
    ret = _returned(folder)
    unchanged = [r for r in ret if r.startswith("primals")]
    assert len(unchanged) >= 3, ret
    assert len(_executable_outputs(folder)) == len(ret) - len(unchanged)


@pytest.mark.stand_in
def test_conv_net_training_steps_match_eager():
    """Three SGD steps (momentum, weight decay) of a conv net: losses and every parameter and
    running statistic as eager's."""
    torch.manual_seed(0)
    model = SmallConvNet()
    reference = copy.deepcopy(model)
    xs = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    ys = [torch.randint(0, 5, (4,)) for _ in range(3)]
    torch._dynamo.reset()
    runs = []
    for m, fn in ((model, torch.compile(model, backend="tpu")), (reference, reference)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        losses = []
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(fn(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs.append((losses, m.state_dict()))
    (got_losses, got), (want_losses, want) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


def test_saved_conv_weight_changed_in_place_raises_as_in_eager():
    """A weight the forward saved as it came, changed in place before the backward: the
    compiled step raises eager's error (the saved tensor is the parameter, whose version
    moved), never a backward from the old values."""
    torch.manual_seed(0)
    model, x = SmallConvNet(), torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu")
    compiled(x).sum().backward()  # compiled and working
    errors = []
    for fn in (model, compiled):
        loss = fn(x).sum()
        with torch.no_grad():
            model.conv2.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            loss.backward()
        errors.append(str(e.value).split(" is at version")[0])  # the same tensor, named alike
    assert errors[0] == errors[1], errors


@pytest.mark.stand_in
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
