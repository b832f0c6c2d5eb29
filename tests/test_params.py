"""Parameters and buffers stay on the device while unchanged; an in-place update re-uploads."""

from __future__ import annotations

import models
import torch

import tpuc


def test_parameters_are_uploaded_once_and_again_after_an_in_place_update():
    model, (x,) = models.make("mlp", batch=4)
    n_params = len(list(model.parameters()))
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for _ in range(4):
            xi = x.clone()  # a new input each call, as in real use
            torch.testing.assert_close(compiled(xi), model(xi), rtol=1e-5, atol=1e-5)
        # Parameters become resident the second time they are seen, then stay.
        assert tpuc.stats()["device_uploads"] == n_params

        model.fc1.weight.mul_(2.0)  # bumps the tensor's version
        torch.testing.assert_close(compiled(x.clone()), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["device_uploads"] == n_params + 1
        torch.testing.assert_close(compiled(x.clone()), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["device_uploads"] == n_params + 1


def test_per_call_inputs_are_never_made_resident():
    model, (x,) = models.make("mlp", batch=4)
    n_params = len(list(model.parameters()))
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for _ in range(5):
            xi = torch.randn_like(x)
            torch.testing.assert_close(compiled(xi), model(xi), rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["device_uploads"] == n_params


def test_buffers_updated_in_place_are_seen():
    model, (x,) = models.make("convnet", batch=2)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        model.bn1.running_mean.add_(0.25)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
