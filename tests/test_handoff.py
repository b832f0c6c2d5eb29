"""Saved activations handed from forward to backward channels-last (python/tpuc/handoff.py).

A training step of a convolutional network under tpuc must give eager's loss and gradients
whether the saved activations travel channels-last (the default), arrive as something else
(a saved-tensor hook that copies them), or the handoff is off; what the user gets back from the
forward keeps eager's row-major layout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import host_kernels_without

import tpuc

# Every test here runs again under TPUC_DEBUG=discrete_device: saved activations cross from forward
# to backward through the device.
pytestmark = pytest.mark.discrete_device


class Convs(nn.Module):
    """Every kind of 2-D convolution the backward lowers channels-last: 3x3 with bias and batch
    norm, strided pointwise, dilated grouped, depthwise, strided 3x3, plus pooling and a
    residual add on the way."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.c2 = nn.Conv2d(16, 32, 1, stride=2, bias=False)
        self.b2 = nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=4)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.c5 = nn.Conv2d(32, 48, 3, stride=2, padding=1)
        self.c6 = nn.Conv2d(48, 48, 1)
        self.fc = nn.Linear(48, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.b1(self.c1(x))))
        y = torch.relu(self.b2(self.c2(x)))
        y = y + self.c3(y)
        y = torch.relu(self.c4(y))
        y = torch.relu(self.c6(self.c5(y)))
        return self.fc(y.mean((2, 3)))


def _steps(model, x, compiled: bool, n: int = 2):
    """`n` SGD steps; returns the losses and the last step's gradients."""
    m = copy.deepcopy(model)
    fn = torch.compile(m, backend="tpu") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = fn(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        opt.step()
    return losses, grads


def _assert_close(got, want):
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    assert got_losses == pytest.approx(want_losses, rel=1e-4)
    for k, want_g in want_grads.items():
        # Relative to the layer's largest gradient of all layers: a bias before batch norm has
        # a gradient of rounding noise only.
        scale = max(g.abs().max().item() for g in want_grads.values())
        err = (got_grads[k] - want_g).abs().max().item() / scale
        assert err < 1e-4, f"{k}: {err}"


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return Convs(), torch.randn(4, 3, 32, 32)


def test_training_matches_eager_with_channels_last_handoff(model_and_input):
    model, x = model_and_input
    torch._dynamo.reset()
    tpuc.reset_stats()
    got = _steps(model, x, compiled=True)
    # The activations after c2 are made channels-last (c1 and c5, small convolutions lowered
    # as tap products, run NCHW, and the inputs and weights are the caller's).
    assert tpuc.stats()["saved_channels_last"] >= 5
    _assert_close(got, _steps(model, x, compiled=False))


def test_saved_tensor_hook_that_copies(model_and_input):
    """A pack hook that stores a row-major copy: the backward gets NCHW-contiguous tensors
    where it expected channels-last ones, and must still be exact."""
    model, x = model_and_input
    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
        got = _steps(model, x, compiled=True)
    _assert_close(got, _steps(model, x, compiled=False))


def test_off_switch(model_and_input, monkeypatch):
    model, x = model_and_input
    monkeypatch.setenv("TPUC_HOST_KERNELS", host_kernels_without("handoff"))
    torch._dynamo.reset()
    tpuc.reset_stats()
    got = _steps(model, x, compiled=True)
    assert tpuc.stats()["saved_channels_last"] == 0
    _assert_close(got, _steps(model, x, compiled=False))


def test_user_outputs_keep_eager_layout():
    """A forward output that is also saved for the backward (the convolution's result, returned
    to the user) comes back row-major, as eager returns it."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def f(x):
        y = conv(x)
        return y, torch.relu(bn(y)).sum()

    x = torch.randn(2, 3, 16, 16)
    torch._dynamo.reset()
    y, loss = torch.compile(f, backend="tpu")(x)
    assert y.is_contiguous()
    loss.backward()
    want_y, _ = f(x)
    assert torch.allclose(y, want_y, atol=1e-5)
