"""`torch._assert_async` in a compiled graph (diffusers' models assert data-dependent conditions
with it): the condition is computed by the compiled graph and checked on the host after each
call, so an assert that holds costs nothing else and one that fails raises as in eager."""

from __future__ import annotations

import pytest
import torch

import tpuc


def f(x):
    torch._assert_async(x.sum() > 0, "sum must be positive")
    torch._assert_async((x < 100).all(), "values must stay below 100")
    return x * 2


def compiled():
    torch._dynamo.reset()
    return torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})


def test_assert_that_holds_passes():
    x = torch.ones(4)
    torch.testing.assert_close(compiled()(x), f(x))
    assert tpuc.stats()["fallback_ops"] == {}


@pytest.mark.parametrize("bad", [-torch.ones(4), torch.full((4,), 200.0)])
def test_assert_that_fails_raises_like_eager(bad):
    with pytest.raises(RuntimeError) as eager:
        f(bad)
    fn = compiled()
    fn(torch.ones(4))  # compiled with a holding assert, then called with a failing one
    with pytest.raises(RuntimeError) as got:
        fn(bad)
    assert str(got.value) == str(eager.value)
