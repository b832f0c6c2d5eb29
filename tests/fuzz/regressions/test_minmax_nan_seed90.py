"""Fuzzer regression minmax_nan_seed90: mismatch: output 0: NaN at different places (0 vs eager 1)"""

import torch
from fuzz.runner import run_fn

nan, inf = float("nan"), float("inf")


def program(v0, v1):
    v2 = torch.minimum(v1, v0)
    return (v2,)


def inputs():
    return [
        torch.tensor([[-2.25, -1.0, 2.75, 0.5, nan]], dtype=torch.float32),
        torch.tensor([[-inf]], dtype=torch.float32),
    ]


def test_minmax_nan_seed90():
    outcome = run_fn(program, inputs(), exact=[True])
    assert outcome.kind in ("ok", "error"), outcome.detail
