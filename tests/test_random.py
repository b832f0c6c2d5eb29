"""Random ops compiled by tpuc (dropout): PyTorch's semantics and statistics, a fresh mask every
call, repeatable under `torch.manual_seed`, gradients through the same mask, and no fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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


N = 1 << 16


def _z(sample_mean, mean, sd, n=N):
    """How many standard errors a sample mean of n draws is from the expected mean."""
    return abs(sample_mean - mean) / (sd / n**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rand_and_randn_statistics_fresh_draws_and_manual_seed(dtype):
    """torch.rand / rand_like: uniform in [0, 1); torch.randn / randn_like: standard normal.
    Means and variances within 5 standard errors of 65536 draws; a fresh draw every call; the
    same draw after the same torch.manual_seed."""
    torch._dynamo.reset()

    def draws(x):
        return (
            torch.rand(x.shape, dtype=dtype),
            torch.rand_like(x, dtype=dtype),
            torch.randn(x.shape, dtype=dtype),
            torch.randn_like(x, dtype=dtype),
        )

    compiled = torch.compile(draws, backend="tpu", options={"fallback": "error"})
    x = torch.empty(N)
    torch.manual_seed(7)
    first = compiled(x)
    torch.manual_seed(7)
    again = compiled(x)
    later = compiled(x)
    assert tpuc.stats()["executions"] == 3, "ran compiled, not in eager PyTorch"
    for a, b, c in zip(first, again, later, strict=True):
        assert a.dtype == dtype and a.shape == x.shape
        assert torch.equal(a, b), "torch.manual_seed repeats the draw"
        assert not torch.equal(a, c), "every call draws anew"
    for u in first[:2]:
        u = u.double()
        assert 0 <= u.min() and u.max() < 1
        # Uniform: mean 1/2, variance 1/12 (sd of a squared deviation: sqrt(1/80 - 1/144)).
        assert _z(u.mean().item(), 0.5, 12**-0.5) < 5
        assert _z(((u - 0.5) ** 2).mean().item(), 1 / 12, (1 / 80 - 1 / 144) ** 0.5) < 5
    for z in first[2:]:
        z = z.double()
        assert _z(z.mean().item(), 0.0, 1.0) < 5
        assert _z((z**2).mean().item(), 1.0, 2**0.5) < 5  # variance 1 (sd of z^2: sqrt(2))
        assert z.abs().max() < 6.5 and (z.abs() > 3).double().mean() < 0.005


def test_random_ops_of_one_graph_draw_independent_streams():
    """Each random node draws its own stream: two dropouts of one input, or two torch.rand,
    are unrelated, also shifted by an element (streams told apart by Threefry's counter overlap:
    the second mask was the first shifted by one)."""
    torch._dynamo.reset()

    def two_of_each(x):
        return F.dropout(x, 0.5), F.dropout(x, 0.5), torch.rand(x.shape), torch.rand(x.shape)

    a, b, r, s = torch.compile(two_of_each, backend="tpu", options={"fallback": "error"})(torch.ones(N))
    ma, mb = a != 0, b != 0
    for shift in range(4):
        agree = (ma[shift:] == mb[: N - shift]).double().mean().item()
        assert _z(agree, 0.5, 0.5) < 5, (shift, agree)
        assert (r[shift:] == s[: N - shift]).double().mean() < 0.01, shift
    assert abs(torch.corrcoef(torch.stack([r, s]))[0, 1]) < 5 / N**0.5


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_stochastic_depth_bernoulli_statistics_and_gradients(p):
    """torchvision's stochastic depth (`empty(...).bernoulli_(1 - p)`: aten.bernoulli.p) compiled:
    whole rows kept with probability 1 - p and scaled by 1 / (1 - p), repeatable under
    torch.manual_seed, and the gradient flows through the same mask."""
    torchvision = pytest.importorskip("torchvision")
    torch._dynamo.reset()

    def drop(x):
        return torchvision.ops.stochastic_depth(x, p, "row", training=True)

    compiled = torch.compile(drop, backend="tpu", options={"fallback": "error"})
    x = (torch.rand(4096, 8) + 0.5).requires_grad_()
    torch.manual_seed(1)
    out = compiled(x)
    torch.manual_seed(1)
    assert torch.equal(out, compiled(x))
    assert tpuc.stats()["executions"] >= 2 and tpuc.stats()["fallback_ops"] == {}
    kept = out[:, 0] != 0
    assert (out != 0).eq(kept[:, None]).all(), "whole rows are kept or dropped"
    assert _z(kept.double().mean().item(), 1 - p, (p * (1 - p)) ** 0.5, n=4096) < 5
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept[:, None].float().expand_as(x) / (1 - p))


def test_efficientnet_b0_trains_with_every_op_compiled():
    """EfficientNet-B0 in train mode (stochastic depth, dropout, BatchNorm): forward and backward
    with fallback="error", so every op of both graphs lowers (a target has no PyTorch to fall
    back to: it raised `no lowering rule for aten.bernoulli.p`)."""
    torchvision = pytest.importorskip("torchvision")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(num_classes=10).train()
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    out = compiled(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    grads = [q.grad for q in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert tpuc.stats()["fallback_ops"] == {}
