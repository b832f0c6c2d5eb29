"""Fuzzer regression sign_nan_seed12: mismatch: output 0: NaN at different places (1 vs eager 0)"""

import torch
from fuzz.runner import run_fn

nan, inf = float("nan"), float("inf")


def program(v0):
    v1 = torch.sign(v0)
    return (v1,)


def inputs():
    return [
        torch.tensor(
            [[[1.25], [-3.75]], [[-2.25], [inf]], [[nan], [-2.0]], [[-2.5], [-3.75]], [[-3.75], [3.5]]],
            dtype=torch.float32,
        )
    ]


def test_sign_nan_seed12():
    outcome = run_fn(program, inputs(), exact=[True])
    assert outcome.kind in ("ok", "error"), outcome.detail
