"""Fuzzer regression dynamic_flatten_alias_seed1041 (dynamic-dims mode): internal RuntimeError:
setStorage: sizes [112], strides [1], storage offset 0, and itemsize 8 requiring a storage size of
896 are out of bounds for storage of size 504.

An output that is a view of an input (`v.flatten()`), with dim 0 of the input bucketed (9 padded
to 16): tpuc's unpadded output was a view of the padded buffer, and AOTAutograd, which rebuilds
such outputs from the input, replayed the view from that larger buffer's shape."""

import pytest
import torch

CASES = {
    "seed1041": lambda v: (v > v, v.flatten()),
    "flatten_only": lambda v: (v.flatten(),),
    "reshape": lambda v: (v.reshape(-1, 2), v * 2),
}


@pytest.mark.parametrize("name", CASES)
def test_output_aliasing_a_bucketed_input(name):
    fn = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(
        fn, backend="tpu", dynamic=False, options={"fallback": "error", "cache_dir": None}
    )
    try:
        for size in (9, 4, 13):
            x = torch.arange(size * 7 * 2).reshape(size, 7, 2)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=16)
            got, want = compiled(x), fn(x)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and torch.equal(g, w), (size, g.shape, w.shape)
    finally:
        torch._dynamo.reset()
