"""A whole training step compiled with backend="tpu" (zero_grad, forward, loss.backward(),
optimizer.step() in one compiled function) runs as one tpuc program per step (whole_step.py,
docs/training.md), and what splits a step still matches eager; the other shapes of code where a tpuc graph runs
while Dynamo's frame callback is live: a compiled model called from a compiled function, a
backward run inside a compiled step, nested torch.compile calls. Dynamo must never trace tpuc's
own code (untraced.py): each test watches the frames Dynamo starts tracing, and compares with
eager PyTorch, and with aot_eager and Inductor on the same model and inputs."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import assert_close_scaled

import tpuc

# Parameters and optimizer state after STEPS steps are compared with `zoo.assert_close_scaled`:
# within 1e-4 of the tensor's largest magnitude (the tolerance of test_zoo_training's gradients).
STEPS = 10


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _cnn():
    # No bias before a BatchNorm: its gradient is zero up to rounding, which Adam's normalized
    # update turns into steps of the full learning rate in a random direction (eager, aot_eager
    # and tpu then differ by the learning rate itself).
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 4),
    )


MODELS = {"mlp": (_mlp, (16, 32), (16, 8)), "cnn": (_cnn, (4, 3, 16, 16), (4, 4))}

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "sgd_weight_decay": lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=1e-2),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    # Default arguments, as users write them (no capturable=True).
    "adam_default": lambda p: torch.optim.Adam(p),
    "adamw_default": lambda p: torch.optim.AdamW(p),
}
# Also run through aot_eager (the others: tpu against eager only, to keep the file's time down).
WITH_AOT_EAGER = ("sgd", "sgd_momentum", "adamw")
# The one graph break left in a whole step: Dynamo runs zero_grad eagerly before the rest of the
# frame, which costs no program.
ZERO_GRAD_BREAK = "Attempted to inline function marked as skipped"


@contextlib.contextmanager
def dynamo_traced_files():
    """The files of the frames Dynamo starts tracing while the block runs (its INFO log line
    "torchdynamo start tracing NAME FILE:LINE")."""
    files: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            m = re.search(r"torchdynamo start tracing \S+ (\S+):\d+", record.getMessage())
            if m:
                files.append(m.group(1))

    # Only this logger's records, kept from torch's own handlers (which would print them).
    logger = logging.getLogger("torch._dynamo.symbolic_convert")
    handler, level, propagate = Collect(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield files
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def assert_tpuc_untraced(files):
    package = tpuc.__file__.rsplit("/", 1)[0] + "/"
    ours = sorted({f for f in files if f.startswith(package)})
    assert not ours, f"Dynamo traced tpuc's own code: {ours}"


def _batches(name, n):
    _, xs, ys = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(xs, generator=g), torch.randn(ys, generator=g)) for _ in range(n)]


def _train(backend, model_name, opt_name, steps=STEPS, set_to_none=True, peek=None, micro=1, clip=None):
    """(losses, model, optimizer, executions per step) after `steps` compiled steps from the same
    start; backend None runs eager. `peek`: a dict the step writes the loss's value into
    (`.item()` between forward and backward, which splits the step); `micro`: gradients
    accumulated over that many micro-batches (a backward each) before the update; `clip`: the
    gradients' largest norm (clip_grad_norm_ before the update)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name][0]().train()
    opt = OPTIMIZERS[opt_name](model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=set_to_none)
        if micro > 1:
            for xb, yb in zip(x.chunk(micro), y.chunk(micro), strict=True):
                (F.mse_loss(model(xb), yb) / micro).backward()
            opt.step()
            return None
        loss = F.mse_loss(model(x), y)
        if peek is not None:
            peek["loss"] = loss.item()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.detach()

    if backend is not None:
        step = torch.compile(step, backend=backend)
    losses, executions = [], []
    for x, y in _batches(model_name, steps):
        before = tpuc.stats()["executions"]
        losses.append(step(x, y))
        executions.append(tpuc.stats()["executions"] - before)
    return losses, model, opt, executions


def assert_same_training(got, want, who):
    losses, model, opt, _ = got
    losses_e, model_e, opt_e, _ = want
    for i, (a, b) in enumerate(zip(losses, losses_e, strict=True)):
        if b is not None:
            assert_close_scaled(a, b, f"{who}: loss of step {i}")
    for (name, p), pe in zip(model.named_parameters(), model_e.parameters(), strict=True):
        assert_close_scaled(p.detach(), pe.detach(), f"{who}: parameter {name}")
    for (name, b), be in zip(model.named_buffers(), model_e.buffers(), strict=True):
        assert_close_scaled(b, be, f"{who}: buffer {name}")
    state, state_e = opt.state_dict()["state"], opt_e.state_dict()["state"]
    assert state.keys() == state_e.keys(), f"{who}: optimizer state of other parameters"
    for k in state:
        assert state[k].keys() == state_e[k].keys(), f"{who}: optimizer state {k}"
        for field, v in state[k].items():
            ve = state_e[k][field]
            if isinstance(v, torch.Tensor):
                assert_close_scaled(v, ve, f"{who}: optimizer state {k}.{field}")
            else:
                assert v == ve, f"{who}: optimizer state {k}.{field}"


@pytest.mark.parametrize(
    "opt_name", [pytest.param(o, marks=pytest.mark.stand_in) if o == "adamw" else o for o in OPTIMIZERS]
)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_compiled_training_step_matches_eager(model_name, opt_name):
    """The whole step is one tpuc program per step (forward, backward and optimizer update; the
    BatchNorm buffers and optimizer state written back), and after 10 steps parameters, buffers
    and optimizer state equal eager's."""
    eager = _train(None, model_name, opt_name)
    tpuc.reset_stats()
    with dynamo_traced_files() as files:
        tpu = _train("tpu", model_name, opt_name)
    assert_tpuc_untraced(files)
    assert_same_training(tpu, eager, "tpu")
    # Steady steps (the second may retrace: the optimizer's state exists from then on).
    assert tpu[3][2:] == [1] * (STEPS - 2), f"tpuc executions per step: {tpu[3]}"
    breaks = tpuc.stats()["graph_breaks"]
    assert all(b.startswith(ZERO_GRAD_BREAK) and "zero_grad" in b for b in breaks), breaks
    # AdamW's addcmul_/addcdiv_ reach tpuc as prims.fma (test_fma.py): nothing runs in PyTorch.
    assert tpuc.stats()["fallback_ops"] == {}
    if opt_name in WITH_AOT_EAGER:
        assert_same_training(_train("aot_eager", model_name, opt_name), eager, "aot_eager")


def test_step_keeping_gradients_is_one_program():
    """zero_grad(set_to_none=False): the gradients exist before the step and are accumulated
    into, still one program per step, and equal eager's (p.grad too)."""
    eager = _train(None, "mlp", "sgd_momentum", set_to_none=False)
    tpu = _train("tpu", "mlp", "sgd_momentum", set_to_none=False)
    assert_same_training(tpu, eager, "tpu")
    assert tpu[3][2:] == [1] * (STEPS - 2), f"tpuc executions per step: {tpu[3]}"
    for p, pe in zip(tpu[1].parameters(), eager[1].parameters(), strict=True):
        assert_close_scaled(p.grad, pe.grad, "gradient after the step")


def test_gradient_accumulation_over_micro_batches_is_one_program():
    """Two micro-batches, a backward each, then the update (a CNN with BatchNorm, whose running
    statistics move twice per step): one program per step, equal to eager."""
    eager = _train(None, "cnn", "adamw", steps=4, micro=2)
    tpu = _train("tpu", "cnn", "adamw", steps=4, micro=2)
    assert_same_training(tpu, eager, "tpu")
    assert tpu[3][2:] == [1, 1], f"tpuc executions per step: {tpu[3]}"


def test_gradient_clipping_is_one_program():
    """clip_grad_norm_ between backward and update (its foreach norm and scaling decomposed into
    ops tpuc lowers), with a norm small enough that it scales every step: one program per step,
    equal to eager."""
    eager = _train(None, "cnn", "sgd_momentum", steps=4, clip=0.05)
    tpuc.reset_stats()
    tpu = _train("tpu", "cnn", "sgd_momentum", steps=4, clip=0.05)
    assert_same_training(tpu, eager, "tpu")
    assert tpu[3][2:] == [1, 1], f"tpuc executions per step: {tpu[3]}"
    assert tpuc.stats()["fallback_ops"] == {}


@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_step_with_a_learning_rate_scheduler_is_one_program(lr):
    """A scheduler attached to the optimizer (it wraps `opt.step` in a function Dynamo skips),
    stepped after every call, the learning rate changing every step: one program per step and
    no retrace per value (a float learning rate becomes symbolic after one recompile, a tensor
    one is an input), equal to eager."""

    def run(backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["mlp"][0]().train()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2) if lr == "tensor" else 1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = torch.compile(step, backend=backend) if backend else step
        losses, executions = [], []
        for x, y in _batches("mlp", STEPS):
            before = tpuc.stats()["executions"]
            losses.append(step(x, y))
            executions.append(tpuc.stats()["executions"] - before)
            sched.step()
        return losses, model, opt, executions

    eager = run(None)
    tpuc.reset_stats()
    tpu = run("tpu")
    assert_same_training(tpu, eager, "tpu")
    assert tpu[3][2:] == [1] * (STEPS - 2), f"tpuc executions per step: {tpu[3]}"
    assert tpuc.stats()["graphs_compiled"] <= 2


def test_item_between_forward_and_backward_splits_the_step_and_stays_exact():
    """A `.item()` between the forward and `loss.backward()` breaks the graph; the backward then
    runs through the autograd engine (Dynamo's traced backward() would find no leaves in the
    second frame and silently skip the gradients: whole_step._backward_within_frame), so the
    step takes several programs and still equals eager; tpuc.stats() says why."""
    peek_e, peek_t = {}, {}
    eager = _train(None, "mlp", "adamw", steps=4, peek=peek_e)
    tpuc.reset_stats()
    tpu = _train("tpu", "mlp", "adamw", steps=4, peek=peek_t)
    assert_same_training(tpu, eager, "tpu")
    assert peek_t["loss"] == pytest.approx(peek_e["loss"], rel=1e-5)
    assert all(n > 1 for n in tpu[3]), tpu[3]
    reasons = tpuc.stats()["graph_breaks"]
    assert any("Tensor.item()" in r for r in reasons), reasons
    assert any(r.startswith("tpuc: backward() over autograd history") for r in reasons), reasons


def test_other_backends_keep_their_graph_breaks():
    """tpuc's hooks act only in frames traced for tpuc: in the same process, after a tpu step,
    aot_eager still breaks at `loss.backward()` and at the optimizer's graph_break(), PyTorch's
    config is untouched, and nothing is counted in tpuc's graph breaks."""
    from torch._dynamo.utils import counters

    _train("tpu", "mlp", "sgd_momentum", steps=2)
    assert torch._dynamo.config.trace_autograd_ops is False
    tpuc.reset_stats()
    counters.clear()
    eager = _train(None, "mlp", "sgd_momentum", steps=3)
    assert_same_training(_train("aot_eager", "mlp", "sgd_momentum", steps=3), eager, "aot_eager")
    reasons = {k.split("\n", 1)[0] for k in counters["graph_break"]}
    assert "Unsupported Tensor.backward() call" in reasons, reasons
    assert "Call to `torch._dynamo.graph_break()`" in reasons, reasons
    assert tpuc.stats()["graph_breaks"] == {}


def test_compiled_training_step_inductor_on_the_same_model_and_inputs():
    """Inductor (the default backend) on the case that crashed (SGD with momentum, a CNN with
    BatchNorm): the same tolerance holds for it as for tpu."""
    eager = _train(None, "cnn", "sgd_momentum")
    assert_same_training(_train("inductor", "cnn", "sgd_momentum"), eager, "inductor")
    assert_same_training(_train("tpu", "cnn", "sgd_momentum"), eager, "tpu")


def _small_mlp_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.randn(8, 16), torch.randn(8, 4)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _eager_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads(model, want, who):
    for i, (g, w) in enumerate(zip(_grads(model), want, strict=True)):
        assert_close_scaled(g, w, f"{who}: gradient {i}")


@pytest.mark.parametrize("outer", ["tpu", "aot_eager", "inductor"])
def test_compiled_model_inside_a_compiled_step(outer):
    """torch.compile(model, backend="tpu") called, and its loss backpropagated, inside a
    function compiled with another torch.compile (Dynamo inlines the inner compiled model into
    the outer graph, whose backend then compiles it)."""
    model, x, y = _small_mlp_and_batch()
    want = _eager_grads(model, x, y)
    cmodel = torch.compile(model, backend="tpu")

    # (zero_grad outside: naming `model` beside `cmodel` in one traced frame trips an
    # assertion in Dynamo's side-effect tracking, with any backend)
    def step(x, y):
        loss = F.mse_loss(cmodel(x), y)
        loss.backward()
        return loss.detach()

    cstep = torch.compile(step, backend=outer)
    with dynamo_traced_files() as files:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = cstep(x, y)
            _assert_grads(model, want, outer)
    assert_tpuc_untraced(files)
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach())


def test_backward_of_a_compiled_model_run_by_another_compiled_function():
    """A tpu-compiled forward after a graph break, and its backward started inside a second
    compiled function (`loss.backward()` breaks Dynamo's graph and runs under its frame
    callback): the tpu backward runs there, untraced."""
    model, x, y = _small_mlp_and_batch()
    want = _eager_grads(model, x, y)
    cmodel = torch.compile(model, backend="tpu")

    def forward(x):
        h = x * 1.0
        torch._dynamo.graph_break()
        return cmodel(h)

    cforward = torch.compile(forward, backend="tpu")
    cbackward = torch.compile(lambda loss: loss.backward(), backend="tpu")
    with dynamo_traced_files() as files:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            before = tpuc.stats()["executions"]
            cbackward(F.mse_loss(cforward(x), y))
            assert tpuc.stats()["executions"] - before == 3, "x * 1.0, the model's forward and backward"
            _assert_grads(model, want, "tpu")
    assert_tpuc_untraced(files)


def test_tpu_compiled_model_inside_a_disabled_region_of_a_compiled_function():
    """Nested torch.compile calls through `torch.compiler.disable`: the outer compiled function
    leaves a helper to eager, and the helper runs a tpu-compiled model forward and backward."""
    model, x, y = _small_mlp_and_batch()
    want = _eager_grads(model, x, y)
    cmodel = torch.compile(model, backend="tpu")

    @torch.compiler.disable
    def train_on(x, y):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(cmodel(x), y)
        loss.backward()
        return loss.detach()

    couter = torch.compile(lambda x, y: train_on(x * 1.0, y) + 1, backend="tpu")
    with dynamo_traced_files() as files:
        for _ in range(3):
            out = couter(x, y)
            _assert_grads(model, want, "tpu")
    assert_tpuc_untraced(files)
    torch.testing.assert_close(out, F.mse_loss(model(x), y).detach() + 1)


# A step as written at a script's top level: `model`, `opt`, `x` and `y` are module globals, and
# after `zero_grad` it names no `torch` module, so Dynamo's resume function after that graph
# break has no tensors by its own test ("no tensor-related objects found in frame").
_TOP_LEVEL_STEP = """
def step():
    opt.zero_grad(set_to_none=True)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()
"""


class _UserMLP(nn.Module):
    """A model of the user's own (its forward is not PyTorch's code, which Dynamo would run
    eagerly as a frame of its own)."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return self.net(x)


def _top_level_training(backend, steps=4):
    torch.manual_seed(0)
    model = _UserMLP()
    ns = {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        "x": torch.randn(16, 32),
        "y": torch.randn(16, 8),
    }
    exec(_TOP_LEVEL_STEP, ns)  # noqa: S102 - the step's source above, defined among its globals
    step = ns["step"] if backend is None else torch.compile(ns["step"], backend=backend)
    per_call = []
    for _ in range(steps):
        before = tpuc.stats()["executions"]
        step()
        per_call.append(tpuc.stats()["executions"] - before)
    return model, per_call


def test_step_written_at_top_level_is_one_program():
    """The resume functions Dynamo makes in tpuc's frames are traced even when they name only
    globals (whole_step.py, item 5): one program per step, equal to eager."""
    torch._dynamo.reset()
    want, _ = _top_level_training(None)
    got, per_call = _top_level_training("tpu")
    assert per_call == [1] * len(per_call), f"tpuc executions per step: {per_call}"
    for p, pe in zip(got.parameters(), want.parameters(), strict=True):
        assert_close_scaled(p, pe, "parameter after the steps")
