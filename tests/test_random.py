"""Random ops compiled by tpuc (dropout): PyTorch's semantics and statistics, a fresh mask every
call, repeatable under `torch.manual_seed`, gradients through the same mask, and no fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tpuc


def _dropout_model(p):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Dropout(p)).train()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_scaling_and_fresh_masks(p):
    torch._dynamo.reset()
    model = _dropout_model(p)
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    x = torch.randn(64, 64)
    before = tpuc.stats()["executions"]
    a, b = compiled(x), compiled(x)
    assert tpuc.stats()["executions"] == before + 2, "ran compiled, not in eager PyTorch"
    full = model[0](x)
    for out in (a, b):
        kept = out != 0
        # 4096 Bernoulli(1 - p) draws: the kept fraction is within 5 standard deviations.
        sd = (p * (1 - p) / out.numel()) ** 0.5
        assert abs(kept.float().mean().item() - (1 - p)) < 5 * sd, kept.float().mean()
        torch.testing.assert_close(out[kept], full[kept] / (1 - p))
    assert (a != 0).ne(b != 0).any(), "every call draws a new mask"


def test_dropout_repeats_under_manual_seed_and_gradients_use_the_mask():
    torch._dynamo.reset()
    model = _dropout_model(0.5)
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    x = torch.randn(16, 64, requires_grad=True)
    torch.manual_seed(123)
    a = compiled(x)
    torch.manual_seed(123)
    b = compiled(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    a.sum().backward()
    # d(sum)/dx = (mask * 2) @ W: rebuild the mask from the output.
    mask = (a != 0).float()
    torch.testing.assert_close(x.grad, (mask * 2) @ model[0].weight, rtol=1e-5, atol=1e-5)


def test_dropout_in_eval_mode_and_p_zero_is_the_identity():
    torch._dynamo.reset()
    model = _dropout_model(0.5).eval()
    x = torch.randn(8, 64)
    with torch.no_grad():
        out = torch.compile(model, backend="tpu", options={"fallback": "error"})(x)
        torch.testing.assert_close(out, model(x))
    torch._dynamo.reset()
    f = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.0, training=True), backend="tpu")
    torch.testing.assert_close(f(x), x)
