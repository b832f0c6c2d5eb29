"""Parameters and buffers stay on the device while unchanged; an in-place update re-uploads; and
whatever ordinary PyTorch does to a parameter's memory between calls is seen. (The counting tests
ask for residency="versioned", which keeps copies too, so that they count the same under
TPUC_DEBUG=discrete_device.)"""

from __future__ import annotations

import models
import pytest
import torch

import tpuc

# Every test here runs again under TPUC_DEBUG=discrete_device: residency of parameters and buffers
# is what the mode changes.
pytestmark = pytest.mark.discrete_device


def test_parameters_are_uploaded_once_and_again_after_an_in_place_update():
    model, (x,) = models.make("mlp", batch=4)
    n_params = len(list(model.parameters()))
    compiled = torch.compile(model, backend="tpu", options={"residency": "versioned"})
    # Where a resident buffer is the tensor's memory (the CPU plugin), an in-place update is
    # read where it lies; a copy (a device with memory of its own) is uploaded again.
    reupload = 0 if tpuc.runtime.get_runtime(None).host_zero_copy else 1
    with torch.no_grad():
        for _ in range(4):
            xi = x.clone()  # a new input each call, as in real use
            torch.testing.assert_close(compiled(xi), model(xi), rtol=1e-5, atol=1e-5)
        # Parameters become resident the second time they are seen, then stay.
        assert tpuc.stats()["device_uploads"] == n_params

        model.fc1.weight.mul_(2.0)  # bumps the tensor's version
        torch.testing.assert_close(compiled(x.clone()), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["device_uploads"] == n_params + reupload
        torch.testing.assert_close(compiled(x.clone()), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["device_uploads"] == n_params + reupload


def test_inputs_written_in_place_every_call_stay_resident():
    """A static KV cache: a buffer the graph itself updates in place at every call (AOTAutograd
    copies the new value back). Its resident buffer is its memory, so each call reads the
    last call's write without uploading it again, and the results follow eager step by step."""

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("kv", torch.zeros(1, 2, 16, 8))
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            pos = torch.arange(1) + self.step
            self.step.add_(1)
            self.kv.index_copy_(2, pos, self.lin(x).view(1, 1, 1, 8).expand(1, 2, 1, 8))
            return (self.kv * 2).sum(2)

    torch.manual_seed(0)
    model = Cache()
    reference = Cache()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(1, 8)
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.kv, reference.kv, rtol=1e-5, atol=1e-5)
            if i == 2:
                uploads = tpuc.stats()["device_uploads"]
        if tpuc.runtime.get_runtime(None).host_zero_copy:
            assert tpuc.stats()["device_uploads"] == uploads
        # Written behind the graph's back, in place and through `.data =`: both are read.
        model.kv.mul_(0.5)
        reference.kv.mul_(0.5)
        model.kv.data = model.kv.data.clone()
        x = torch.randn(1, 8)
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)


def test_per_call_inputs_are_never_made_resident():
    model, (x,) = models.make("mlp", batch=4)
    n_params = len(list(model.parameters()))
    compiled = torch.compile(model, backend="tpu", options={"residency": "versioned"})
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


# Ordinary PyTorch that gives a parameter new memory, or writes it, without bumping `_version`
# (or that frees and re-allocates it, as FSDP2 does between steps). Each runs between compiled
# calls of a model whose parameters are already resident.
def _assign_data(m):
    m[0].weight.data = torch.randn(8, 8)


def _dtype_round_trip(m):
    m.double()
    m.float()


def _unversioned_write(m):
    m[0].weight.data.mul_(2.0)  # `.data` has its own version counter


def _set(m):
    m[2].bias.set_(torch.randn(8))


def _load_state_dict_assign(m):
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)


def _load_state_dict_copy(m):
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})


def _free_and_reallocate(m):
    # FSDP2's unsharded parameters: storage freed after use, re-allocated and refilled later.
    w = m[0].weight
    values = torch.randn(8, 8)
    nbytes = w.untyped_storage().nbytes()
    w.untyped_storage().resize_(0)
    torch.randn(4096)  # take the freed memory
    w.untyped_storage().resize_(nbytes)
    w.data.copy_(values)


def _transpose_in_place_of_data(m):
    m[0].weight.data = m[0].weight.data.t()  # same address, another layout


def _swap_tensors(m):
    torch.utils.swap_tensors(m[2].weight, torch.nn.Parameter(torch.randn(8, 8)))


@pytest.mark.parametrize(
    "change",
    [
        _assign_data,
        _dtype_round_trip,
        _unversioned_write,
        _set,
        _load_state_dict_assign,
        _load_state_dict_copy,
        _free_and_reallocate,
        _transpose_in_place_of_data,
        _swap_tensors,
    ],
    ids=lambda f: f.__name__.lstrip("_"),
)
def test_parameter_changes_between_calls_are_seen(change):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):  # resident from the second call
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        for _ in range(2):
            change(model)
            for _ in range(2):
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_swap_module_params_on_conversion():
    # What nn.Module._apply does under this flag: swap_tensors on every parameter.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    x = torch.randn(4, 8)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            model.double()
            torch.testing.assert_close(compiled(x.double()), model(x.double()))
            model.float()
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_unaligned_parameters_are_read_in_place_every_call():
    # A parameter at an offset the CPU plugin cannot compute on in place would be copied if made
    # resident, and the copy would miss writes PyTorch does not version: it is passed every call.
    flat = torch.randn(8 * 8 + 1)
    model = torch.nn.Linear(8, 8, bias=False)
    model.weight.data = flat[1:].view(8, 8)  # 4 bytes past a 64-byte boundary
    compiled = torch.compile(model, backend="tpu", options={"fallback": "error"})
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        flat.mul_(3.0)  # through another tensor: the weight's version does not move
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
