"""SPMD over 4 CPU devices (meshes 4x1 and 2x2): every strategy gives the results of one device
(fp32 tolerance) for an MLP, a transformer block and a training step of a small decoder LM; the
compiled HLO has the collectives each strategy implies; FSDP keeps a quarter of the parameters on
each device; bad meshes and specs raise errors that name what is wrong."""

from __future__ import annotations

import copy
import gc
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import zoo
from torch import nn

import tpuc

MESHES = {
    "4x1": {"shape": [4], "axes": ["data"]},
    "2x2": {"shape": [2, 2], "axes": ["data", "model"]},
}
STRATEGIES = ["replicated", "data_parallel", "fsdp", "tensor_parallel"]
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _compiled(model, mesh, sharding, **extra):
    torch._dynamo.reset()
    gc.collect()  # frees earlier tests' compiled graphs and the parameters they keep resident
    opts = {"mesh": MESHES[mesh], "sharding": sharding, "fallback": "error", **extra}
    return torch.compile(model, backend="tpu", options=opts)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head attention and a GELU MLP."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


def _forward_backward(model, compiled, x):
    """Output and parameter gradients, eager vs compiled, on copies of the same model."""
    eager = copy.deepcopy(model)
    ref = eager(x)
    ref.square().mean().backward()
    out = compiled(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, **TOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# Under TPUC_DEBUG=discrete_device the MLP runs again for every strategy and mesh (shards uploaded
# per device, gradients copied back), with the tests of resident pieces below; the block and the
# decoder LM check the strategies' numerics, which the mode does not change.
@pytest.mark.discrete_device
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_mlp_matches_one_device(mesh, sharding):
    model = _mlp()
    x = torch.randn(8, 16)
    counted = tpuc.stats()["executions"]
    _forward_backward(model, _compiled(model, mesh, sharding), x)
    assert tpuc.stats()["executions"] == counted + 2, "forward and backward ran through tpuc"


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_transformer_block_matches_one_device(mesh, sharding):
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(4, 6, 32)
    _forward_backward(model, _compiled(model, mesh, sharding), x)


# Each strategy once (a Llama step compiles in 5-10 s); the MLP and block tests cover every pair.
@pytest.mark.parametrize(
    ("mesh", "sharding"),
    [("2x2", "replicated"), ("4x1", "data_parallel"), ("4x1", "fsdp"), ("2x2", "tensor_parallel")],
)
def test_decoder_lm_training_steps_match_one_device(mesh, sharding):
    lm, _ = zoo.make("llama")
    model = zoo.LMLoss(lm.train())
    eager = copy.deepcopy(model)
    compiled = _compiled(model, mesh, sharding)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    torch.manual_seed(2)
    ids = torch.randint(0, zoo.VOCAB, (4, 8))
    target = torch.randint(0, zoo.VOCAB, (4, 8))
    for step in range(2):  # the second step runs on parameters the optimizer updated
        loss, ref = compiled(target, ids), eager(target, ids)
        torch.testing.assert_close(loss, ref, **TOL, msg=lambda m, step=step: f"step {step}: {m}")
        loss.backward()
        ref.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()


def _collectives(dump: Path) -> dict[str, Counter]:
    """Collective ops in XLA's optimized HLO of each dumped graph, by graph kind."""
    out = {}
    for path in sorted(dump.glob("*/optimized_hlo.txt")):
        kind = "forward" if "_forward" in path.parent.name else "backward"
        ops = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|dynamic-slice)\(", path.read_text())
        out[kind] = Counter(ops)
    return out


def test_compiled_hlo_has_the_collectives_of_each_strategy(tmp_path):
    x = torch.randn(8, 16)
    found = {}
    for sharding in ["data_parallel", "fsdp", "tensor_parallel"]:
        model = _mlp()
        dump = tmp_path / sharding
        mesh = "2x2" if sharding == "tensor_parallel" else "4x1"
        compiled = _compiled(model, mesh, sharding, dump_dir=str(dump))
        compiled(x).sum().backward()
        found[sharding] = _collectives(dump)
    # Data parallel: parameters whole, gradients summed over the batch shards.
    assert found["data_parallel"]["forward"]["all-gather"] == 0, found
    assert found["data_parallel"]["backward"]["all-reduce"] >= 1, found
    # FSDP: parameters gathered where used; gradients reduced and scattered (on the CPU plugin
    # XLA keeps this as all-reduce + dynamic-slice; TPU and GPU pipelines fuse it into
    # reduce-scatter).
    assert found["fsdp"]["forward"]["all-gather"] >= 1, found
    back = found["fsdp"]["backward"]
    assert back["reduce-scatter"] >= 1 or (back["all-reduce"] >= 1 and back["dynamic-slice"] >= 1), found
    # Tensor parallel: the row-parallel layer's partial sums are all-reduced.
    assert found["tensor_parallel"]["forward"]["all-reduce"] >= 1, found


@pytest.mark.discrete_device
def test_fsdp_keeps_a_quarter_of_the_parameters_per_device():
    per_device = {}
    for sharding in ["replicated", "fsdp"]:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        compiled = _compiled(model, "4x1", sharding, residency="versioned")
        before = tpuc.resident_bytes() + [0] * 4
        with torch.no_grad():
            for _ in range(3):  # parameters become resident the second time they are seen
                compiled(torch.randn(8, 64))
        per_device[sharding] = [b - a for a, b in zip(before, tpuc.resident_bytes(), strict=False)]
        del compiled
    full = sum(p.numel() * 4 for p in model.parameters())
    assert per_device["replicated"][:4] == [full] * 4, per_device
    ratio = [f / r for f, r in zip(per_device["fsdp"], per_device["replicated"], strict=False)]
    assert all(0.24 < q < 0.27 for q in ratio[:4]), (ratio, per_device)


@pytest.mark.discrete_device
def test_explicit_per_input_specs():
    model = _mlp()
    x = torch.randn(8, 16)
    specs = {0: ("data", None), "0.weight": ("model", None), "2.weight": (None, "model")}
    _forward_backward(model, _compiled(model, "2x2", specs), x)


def test_mesh_larger_than_the_device_count(monkeypatch):
    monkeypatch.setenv("TPUC_CPU_DEVICES", "2")
    model = _mlp()
    with pytest.raises(tpuc.ShardingError, match=r"needs 4 devices.*has 2.*TPUC_CPU_DEVICES"):
        _compiled(model, "4x1", "data_parallel")(torch.randn(8, 16))


def test_batch_not_divisible_by_the_mesh_axis():
    model = _mlp()
    with pytest.raises(
        ValueError, match=r"input `args\[0\]`.*dim 0 has size 6, not divisible by mesh axis data of size 4"
    ):
        _compiled(model, "4x1", "data_parallel")(torch.randn(6, 16))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sharding": "fsdp"}, "needs a device mesh"),
        ({"mesh": MESHES["2x2"], "sharding": {0: ("rows", None)}}, "the mesh has no axis 'rows'"),
        ({"mesh": MESHES["2x2"], "sharding": {5: ("data", None)}}, "the model has 1 tensor input"),
        (
            {"mesh": {"shape": [2, 2], "axes": ["a", "b"]}, "sharding": "fsdp"},
            'needs a mesh axis named "data"',
        ),
    ],
)
def test_bad_sharding_options(options, message):
    torch._dynamo.reset()
    compiled = torch.compile(_mlp(), backend="tpu", options=options)
    with pytest.raises(ValueError, match=re.escape(message)):
        compiled(torch.randn(8, 16))


_CACHED_RUN = """
import sys, torch, tpuc
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
x = torch.randn(8, 8)
opts = {"mesh": {"shape": [4], "axes": ["data"]}, "sharding": "fsdp", "cache_dir": sys.argv[1]}
y = torch.compile(m, backend="tpu", options=opts)(x)
torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-5)
s = tpuc.stats()
print(s["xla_compiles"], s["cache_hits_disk"])
"""


def test_sharded_executables_load_from_the_disk_cache_in_a_new_process(tmp_path):
    import subprocess
    import sys

    runs = [
        subprocess.run(
            [sys.executable, "-c", _CACHED_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout.split() == ["1", "0"], runs[0].stdout
    assert runs[1].stdout.split() == ["0", "1"], "the second process compiles nothing"


def test_precompile_with_a_mesh_says_it_is_not_supported():
    with pytest.raises(NotImplementedError, match="mesh"):
        tpuc.precompile(_mlp(), (torch.randn(8, 16),), options={"mesh": MESHES["4x1"]})


@pytest.mark.discrete_device
@pytest.mark.parametrize("sharding", ["fsdp", "tensor_parallel"])
def test_parameter_changes_between_calls_are_seen(sharding):
    # Resident pieces keyed on the tensor's memory (as for one device): `.data =`, a dtype round
    # trip and a write PyTorch does not version are all seen.
    model = _mlp()
    compiled = _compiled(model, "2x2", sharding)
    x = torch.randn(8, 16)
    with torch.no_grad():
        for change in (
            lambda: None,
            lambda: setattr(model[0].weight, "data", torch.randn(64, 16)),
            lambda: (model.double(), model.float()),
            lambda: model[2].weight.data.mul_(2.0),
            lambda: model[4].weight.data.mul_(-1.0),
        ):
            change()
            for _ in range(2):
                torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_a_whole_training_step_under_fsdp_equals_eager():
    # One program per step on 4 CPU devices: parameters and momentum (split like their
    # parameters) after 4 SGD steps equal eager's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    ref = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, opt

    (step, opt), (ref_step, ref_opt) = make(model), make(ref)
    compiled = _compiled(step, "4x1", "fsdp")
    tpuc.reset_stats()
    for _ in range(4):
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        torch.testing.assert_close(compiled(x, y), ref_step(x, y), **TOL)
    assert tpuc.stats()["executions"] == 4
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"], **TOL
        )
