"""Fuzzer regression gather_empty_seed5053: error: PJRT_Client_Compile failed (UNKNOWN): -:13:10:
error: slice size (1) is out of bounds for operand dimension (0) at index 0

A gather from a zero-size tensor (eager: an empty result) lowered to a stablehlo.gather with
slices of size 1 from a dim of size 0, which XLA rejects. Now every node whose results all have
no elements lowers to empty constants, whatever its op."""

import pytest
import torch
from fuzz.runner import run_fn


def program(v0):
    v1 = torch.gather(v0, 0, torch.zeros_like(v0, dtype=torch.long))
    return (v1,)


def test_gather_empty_seed5053():
    outcome = run_fn(program, [torch.empty([0], dtype=torch.float32)], exact=[True])
    assert outcome.kind == "ok", outcome.detail


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.gather(x, 1, torch.zeros_like(x, dtype=torch.long)),
        lambda x: torch.index_select(x, 1, torch.tensor([0, 0])),
        lambda x: x[..., torch.tensor([0, 1])],
        lambda x: torch.take_along_dim(x, torch.zeros_like(x, dtype=torch.long), 1),
    ],
    ids=["gather", "index_select", "index", "take_along_dim"],
)
def test_indexing_ops_with_an_empty_dim(fn):
    outcome = run_fn(lambda x: (fn(x) + 1,), [torch.empty([0, 3])])
    assert outcome.kind == "ok", outcome.detail
