"""The four reference models through backend="tpu", against eager PyTorch."""

from __future__ import annotations

import models
import pytest
import torch

import tpuc

# Tolerances per dtype: fp32 tight; low precision loose enough for one rounding difference per
# op (PyTorch rounds some intermediate results that tpuc keeps in f32, and vice versa).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
}


def run_both(name, dtype, batch):
    model, inputs = models.make(name, dtype, batch)
    with torch.no_grad():
        expected = model(*inputs)
        compiled = torch.compile(model, backend="tpu", dynamic=False)
        actual = compiled(*inputs)
    return expected, actual


# Run again under TPUC_DEBUG=discrete_device (parameters uploaded every call, outputs copied back);
# the low-precision ones are not: 2-byte inputs and outputs cross the device as int16 ones do in
# test_edge_inputs.py, and their numerics are the mode's own.
@pytest.mark.discrete_device
@pytest.mark.parametrize("name", models.NAMES)
@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.stand_in)])
def test_model_matches_eager_fp32(name, batch):
    expected, actual = run_both(name, torch.float32, batch)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    s = tpuc.stats()
    assert s["xla_compiles"] > 0
    assert s["executions"] == 1
    assert s["fallback_ops"] == {}


@pytest.mark.parametrize("name", models.NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_matches_eager_low_precision(name, dtype):
    expected, actual = run_both(name, dtype, 2)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    assert tpuc.stats()["fallback_ops"] == {}


@pytest.mark.discrete_device
def test_repeated_calls_reuse_the_executable():
    model, (x,) = models.make("mlp", batch=4)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    s = tpuc.stats()
    # One executable (compiled, or found in this process's cache from an earlier test).
    assert s["xla_compiles"] + s["cache_hits_memory"] == 1
    assert s["executions"] == 3


@pytest.mark.discrete_device
def test_new_shape_without_declared_max_compiles_again_from_the_same_graph():
    model, (x,) = models.make("mlp", batch=4)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for batch in (4, 7, 9, 7):
            xb = torch.randn(batch, x.shape[1])
            torch.testing.assert_close(compiled(xb), model(xb), rtol=1e-5, atol=1e-5)
    s = tpuc.stats()
    # 4 -> static graph; 7 -> Dynamo's symbolic graph, specialized for 7, then 9; the second 7 is
    # served by the executable already built for it. (Modules built by earlier tests in this
    # process come from the memory cache.)
    assert s["xla_compiles"] + s["cache_hits_memory"] == 3
    assert s["executions"] == 4


def test_same_module_compiled_twice_hits_the_memory_cache():
    model, (x,) = models.make("convnet", batch=2)
    with torch.no_grad():
        torch.compile(model, backend="tpu")(x)
        torch._dynamo.reset()
        torch.compile(model, backend="tpu")(x)
    s = tpuc.stats()
    # The second trace lowers to the same module and finds it in memory (the first may too, if an
    # earlier test compiled it).
    assert s["xla_compiles"] + s["cache_hits_memory"] == 2
    assert s["cache_hits_memory"] >= 1
