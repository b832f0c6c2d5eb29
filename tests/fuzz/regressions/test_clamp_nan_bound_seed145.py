"""Fuzzer regression clamp_nan_bound_seed145: mismatch: output 0: NaN at different places (1 vs eager 10).

torch.clamp with a NaN bound gives NaN everywhere; the CPU plugin's maximum/minimum drop a NaN in
their second operand (the bound), so tpuc returned the unclamped input."""

import pytest
import torch
from fuzz.runner import run_fn

nan, inf = float("nan"), float("inf")


def program(v0):
    v1 = torch.clamp(v0, min=v0.amin(), max=v0.amax() * 0.5)
    return (v1,)


def inputs():
    return [
        torch.tensor([[[-1.25, 3.25, 1.75, -inf, 3.25], [nan, 2.75, 1.5, 2.0, 1.25]]], dtype=torch.float32)
    ]


def test_clamp_nan_bound_seed145():
    outcome = run_fn(program, inputs(), exact=[True])
    assert outcome.kind in ("ok", "error"), outcome.detail


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, lo, hi: torch.clamp(x, min=lo, max=hi),
        lambda x, lo, hi: torch.clamp(x, min=hi),
        lambda x, lo, hi: torch.clamp(x, max=hi),
        lambda x, lo, hi: torch.clamp(x, min=float("nan")),  # clamp_min
        lambda x, lo, hi: torch.clamp(x, max=float("nan")),  # clamp_max
        lambda x, lo, hi: torch.clamp(x, -0.5, float("nan")),
    ],
    ids=["tensors", "tensor_min", "tensor_max", "scalar_min", "scalar_max", "scalars"],
)
def test_clamp_nan_bounds(fn):
    x = torch.tensor([-2.0, -0.25, 0.0, 0.75, 3.0, nan, inf, -inf])
    outcome = run_fn(lambda x, lo, hi: (fn(x, lo, hi),), [x, torch.tensor(-0.5), torch.tensor(nan)])
    assert outcome.kind == "ok", outcome.detail


def test_clamp_without_nan_keeps_nan_of_self():
    x = torch.tensor([-2.0, -0.25, 0.0, 0.75, 3.0, nan, inf, -inf])
    outcome = run_fn(
        lambda x, lo: (torch.clamp(x, min=lo, max=1.0), torch.clamp(x, -1.0, 1.0)), [x, torch.tensor(-0.5)]
    )
    assert outcome.kind == "ok", outcome.detail
