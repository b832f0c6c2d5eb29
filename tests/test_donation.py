"""Input-output aliasing of the state a program writes (docs/training.md, "Writes"): a written
input whose new value is an output of its type is marked `tf.aliasing_output` in the module, for
a TPU target (memory per chip counts the state once) and on a device with memory of its own
(TPUC_DEBUG=discrete_device: the input's upload for the call is donated to its new value). On
the CPU plugin the inputs are the tensors' own memory, which the plugin copies rather than
writing into, so nothing is aliased there. Either way eager's in-place semantics hold: a
reference or view taken before a step sees the new values, the tensor keeps its memory, the same
tensor passed twice, a written tensor also returned, a step called twice, BatchNorm's running
statistics, and a call that raises leaves the state whole."""

from __future__ import annotations

import copy
import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DISCRETE
from torch import nn
from zoo import assert_close_scaled

import tpuc
from tpuc import runtime, targets

STEPS = 10
needs_libtpu = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None,
    reason="libtpu is not installed (scripts/setup.sh installs it; offline machines skip these)",
)


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


def _step_fn(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _modules(dump_dir) -> list[str]:
    return [
        open(p).read()
        for p in sorted(glob.glob(os.path.join(dump_dir, "**", "stablehlo.mlir"), recursive=True))
    ]


def _state(model, opt) -> dict:
    out = {f"p.{k}": v for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v
    return out


@pytest.mark.discrete_device
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_whole_step_writes_state_in_place_as_eager(model_name, tmp_path):
    """SGD with momentum, one eager step first (the momentum buffers exist), then 10 compiled
    steps: every parameter, momentum buffer and BatchNorm statistic equals eager's; the tensors
    the user held before (a parameter, its momentum buffer, a view of a weight) see the new
    values in the same memory; the module aliases each written input on a discrete device (the
    parameters, the momentum buffers, BatchNorm's running mean, variance and batch count) and
    none on the CPU plugin."""
    torch.manual_seed(0)
    make, xs, ys = (_mlp, (16, 32), (16, 8)) if model_name == "mlp" else (_cnn, (4, 3, 8, 8), (4, 4))
    model = make().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(*xs), torch.randn(*ys)) for _ in range(STEPS + 1)]
    _step_fn(model, opt)(*batches[0])
    _step_fn(ref, ref_opt)(*batches[0])

    weight = next(model.parameters())
    momentum = opt.state[weight]["momentum_buffer"]
    view = weight.view(-1)[:5]
    ptrs = {k: v.data_ptr() for k, v in _state(model, opt).items()}
    torch._dynamo.reset()
    tpuc.reset_stats()
    step = torch.compile(_step_fn(model, opt), backend="tpu", options={"dump_dir": str(tmp_path)})
    ref_step = _step_fn(ref, ref_opt)
    for x, y in batches[1:]:
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-6)
    assert tpuc.stats()["executions"] == STEPS  # one program per step

    got, want = _state(model, opt), _state(ref, ref_opt)
    assert got.keys() == want.keys()
    for k in want:
        assert_close_scaled(got[k], want[k], k)
        assert got[k].data_ptr() == ptrs[k], f"{k} moved"
    ref_weight = next(ref.parameters())
    assert weight is next(model.parameters()) and momentum is opt.state[weight]["momentum_buffer"]
    torch.testing.assert_close(view, ref_weight.view(-1)[:5], rtol=1e-4, atol=1e-6)
    assert_close_scaled(momentum, ref_opt.state[ref_weight]["momentum_buffer"], "held momentum")

    (module,) = _modules(tmp_path)
    written = len(got)  # every parameter, buffer and momentum buffer is written by the step
    assert module.count("tf.aliasing_output") == (written if DISCRETE else 0)


@pytest.mark.discrete_device
def test_resident_state_is_never_donated():
    """With `residency="versioned"` the parameters may stay on the device between calls (as
    copies): a resident buffer is read again by the next call, so it is never donated, and the
    steps equal eager's (a donated resident buffer would be read after it was given away)."""
    torch.manual_seed(0)
    model = _mlp().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    step = torch.compile(_step_fn(model, opt), backend="tpu", options={"residency": "versioned"})
    ref_step = _step_fn(ref, ref_opt)
    for _ in range(5):
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-6)
    got = _state(model, opt)
    for k, v in _state(ref, ref_opt).items():
        assert_close_scaled(got[k], v, k)


@pytest.mark.discrete_device
def test_writes_through_aliases_and_repeated_calls_match_eager():
    """An ordinary compiled function (not a whole step) that writes into its inputs under
    no_grad: the same tensor passed as two inputs, a written tensor also returned, a view of a
    written tensor held by the caller, and the function called twice with the same inputs."""

    @torch.no_grad()
    def update(params, grads, other):
        for p, g in zip(params, grads, strict=True):
            p.add_(g, alpha=-0.1)
        other.mul_(2)
        return params[0], other + 1

    def run(fn):
        torch.manual_seed(0)
        params = [torch.randn(64, 32, requires_grad=True), torch.randn(64, requires_grad=True)]
        grads = [torch.randn(64, 32), torch.randn(64)]
        other = torch.randn(128)
        view = params[0][3]
        outs = []
        for _ in range(2):  # the same inputs twice
            first, other_plus = fn(params, grads, other)
            outs.append((first.clone(), other_plus))
            assert first is params[0] or first.data_ptr() == params[0].data_ptr()
        outs.append(fn([params[1], params[1]], [grads[1], grads[1]], other))  # one tensor twice
        return params, other, view, outs

    want = run(update)
    torch._dynamo.reset()
    got = run(torch.compile(update, backend="tpu"))
    torch.testing.assert_close(got, want)


@pytest.mark.discrete_device
def test_a_call_that_raises_leaves_the_state_whole_and_the_next_call_exact():
    """A step that writes its state and then fails a check (`torch._assert_async`): no tensor
    holds a half-written or donated value after the error, and the next call that passes the
    check continues from whole state, as eager does."""

    def step(p, m, x):
        with torch.no_grad():
            m.mul_(0.9).add_(x)
            p.add_(m, alpha=-0.1)
        torch._assert_async(x.sum() > 0, "sum must be positive")
        return p.sum()

    torch.manual_seed(0)
    p0, m0 = torch.randn(256), torch.randn(256)
    good, bad = torch.rand(256), -torch.rand(256)
    compiled = torch.compile(step, backend="tpu", dynamic=False)
    p, m = p0.clone(), m0.clone()
    compiled(p, m, good)
    before = (p.clone(), m.clone())
    with pytest.raises(RuntimeError, match="sum must be positive"):
        compiled(p, m, bad)
    # Either untouched (tpuc checks before writing back) or fully written (eager writes first).
    written = (before[0] - 0.1 * (0.9 * before[1] + bad), 0.9 * before[1] + bad)
    assert any(
        torch.allclose(p, a, atol=1e-6) and torch.allclose(m, b, atol=1e-6) for a, b in (before, written)
    ), "half-written state after the error"
    ep, em = p.clone(), m.clone()
    torch.testing.assert_close(compiled(p, m, good), step(ep, em, good))
    torch.testing.assert_close((p, m), (ep, em))


def _step_module_for_v5e(model, opt, x, y, tmp_path) -> str:
    """The StableHLO module of `model`'s SGD step compiled for v5e (compile-only, dumped under
    `tmp_path / "dump"`), after one eager step (the momentum buffers exist: inputs)."""
    step = _step_fn(model, opt)
    step(x, y)
    torch._dynamo.reset()
    options = {
        "target": "tpu:v5e:2x2",
        "cache_dir": str(tmp_path / "cache"),
        "dump_dir": str(tmp_path / "dump"),
    }
    with pytest.raises(targets.TargetUnavailableError):
        torch.compile(step, backend="tpu", options=options)(x, y)
    (module,) = _modules(tmp_path / "dump")
    return module


@needs_libtpu
def test_a_whole_step_for_a_tpu_target_aliases_its_state(tmp_path):
    """The MLP's SGD-momentum step compiled for v5e (compile-only): each parameter and momentum
    buffer is an argument aliased to its new value, and XLA's memory analysis counts their bytes
    as aliased (held once per chip, not as an argument and again as an output)."""
    torch.manual_seed(0)
    model = _mlp().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    module = _step_module_for_v5e(model, opt, torch.randn(16, 32), torch.randn(16, 8), tmp_path)
    (meta,) = glob.glob(str(tmp_path / "dump" / "**" / "meta.json"), recursive=True)
    state = [*model.parameters(), *(opt.state[p]["momentum_buffer"] for p in model.parameters())]
    assert module.count("tf.aliasing_output") == len(state)
    aliased = json.load(open(meta))["hbm_bytes"]["aliased"]
    assert aliased >= sum(t.numel() * t.element_size() for t in state)


@needs_libtpu
def test_a_tpu_step_copies_its_batchnorm_counter(tmp_path):
    """For a TPU target BatchNorm's `num_batches_tracked` (an int64 scalar) is returned, not
    aliased: XLA:TPU emulates 64-bit values and kept temporaries for an aliased one (ResNet-18's
    step: 16.8 MB, docs/training.md); every float tensor the step writes is still aliased."""
    torch.manual_seed(0)
    model = _cnn().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    module = _step_module_for_v5e(model, opt, torch.randn(4, 3, 8, 8), torch.randn(4, 4), tmp_path)
    floats = [t for t in _state(model, opt).values() if t.is_floating_point()]
    assert module.count("tf.aliasing_output") == len(floats)
    head = module.split("^bb0(", 1)[1].split(")", 1)[0]  # main's arguments
    assert "tensor<i64>" in head  # the counter is an input, written but not aliased


def _outputs_of_the_program(dump_dir) -> int:
    (meta,) = glob.glob(os.path.join(dump_dir, "**", "meta.json"), recursive=True)
    return len(json.load(open(meta))["outputs"])


@pytest.mark.parametrize("where", ["start", "end"])
def test_gradients_leave_the_program_only_where_the_user_can_read_them(where, tmp_path):
    """`opt.zero_grad(set_to_none=True)` at the start of the step leaves the step's gradients
    in `p.grad` (eager semantics): the program returns them. At the end, after `opt.step()`,
    eager's `p.grad` is None after the step: the program returns no gradient (the zero_grad is
    traced as `.grad = None` instead of breaking the graph after the update, which made every
    gradient an output and split the step), and the step is one program equal to eager."""
    torch.manual_seed(0)
    model = _mlp().train()
    ref = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            if where == "start":
                opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            if where == "end":
                opt.zero_grad()
            return loss.detach()

        return step, opt

    step, opt = make(model)
    ref_step, ref_opt = make(ref)
    batches = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(4)]
    step(*batches[0]), ref_step(*batches[0])  # the momentum buffers exist
    torch._dynamo.reset()
    tpuc.reset_stats()
    compiled = torch.compile(step, backend="tpu", options={"dump_dir": str(tmp_path)})
    for x, y in batches[1:]:
        torch.testing.assert_close(compiled(x, y), ref_step(x, y), rtol=1e-4, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert_close_scaled(p.grad, q.grad, "grad")
    assert tpuc.stats()["executions"] == len(batches) - 1  # one program per step
    # At the start, zero_grad runs eagerly before the graph (a break that costs no program).
    assert len(tpuc.stats()["graph_breaks"]) == (1 if where == "start" else 0)
    for k, v in _state(ref, ref_opt).items():
        assert_close_scaled(_state(model, opt)[k], v, k)
    params = len(list(model.parameters()))
    # loss, the new parameters and momentum buffers, and the gradients where they are kept
    assert _outputs_of_the_program(tmp_path) == 1 + 2 * params + (params if where == "start" else 0)


def test_backward_after_a_traced_zero_grad_keeps_its_gradients():
    """A backward() after the traced `zero_grad()` in the same frame (the next step's gradients
    computed ahead): it must not accumulate into the gradients the traced clear dropped, so the
    graph breaks there; parameters and `p.grad` equal eager's."""
    torch.manual_seed(0)
    model = _mlp().train()
    ref = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            F.mse_loss(m(y @ torch.ones(8, 32)), y).backward()
            return loss.detach()

        return step

    step, ref_step = torch.compile(make(model), backend="tpu"), make(ref)
    for _ in range(3):
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close_scaled(p, q, "param")
        assert_close_scaled(p.grad, q.grad, "grad")


@pytest.mark.discrete_device
def test_a_step_loaded_from_the_autograd_cache_aliases_as_compiled(tmp_path):
    """A whole step compiled again after `torch._dynamo.reset()` comes from AOTAutograd's cache:
    its graph is unpickled, and the pairs of written inputs travel beside it, so the module is the
    first compile's (aliased alike: on a discrete device every written tensor), tpuc compiles
    nothing, and the steps equal eager's."""
    torch.manual_seed(0)
    model = _mlp().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(5)]
    _step_fn(model, opt)(*batches[0])
    ref_step = _step_fn(ref, ref_opt)
    ref_step(*batches[0])
    cache, hits, modules = str(tmp_path / "cache"), [], []
    for i, (x, y) in enumerate(batches[1:3]):
        torch._dynamo.reset()
        tpuc.reset_stats()
        before = torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]
        dump = tmp_path / f"dump{i}"
        step = torch.compile(
            _step_fn(model, opt), backend="tpu", options={"cache_dir": cache, "dump_dir": str(dump)}
        )
        for _ in range(2):
            torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-6)
        hits.append(torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] - before)
        modules.append(_modules(dump))
    assert hits == [0, 1]
    assert tpuc.stats()["xla_compiles"] == 0  # the loaded graph's module is the cached executable's
    written = len(_state(model, opt))
    assert [m.count("tf.aliasing_output") for (m,) in modules] == [written if DISCRETE else 0] * 2
    for k, v in _state(ref, ref_opt).items():
        assert_close_scaled(_state(model, opt)[k], v, k)
