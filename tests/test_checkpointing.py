"""Activation checkpointing (`torch.utils.checkpoint`, selective policies) is honored by tpuc:
in a whole training step (one program), the backward's recomputation stays a recomputation
(tpuc's cse keeps the `*_recomputed` copies apart, lowering puts their inputs behind a
`stablehlo.optimization_barrier` so XLA does not merge them back either); in the split road (a
model compiled alone, `loss.backward()` outside) AOTAutograd's partitioner recomputes in the
backward graph and the forward saves less. A transformers Llama checkpointed per decoder layer
is one program when its step asks for no KV cache. Numbers equal eager PyTorch's after a few
steps (docs/training.md, "Activation checkpointing")."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from zoo import assert_close_scaled

import tpuc

BLOCKS = 3
WIDTH = 32
STEPS = 3
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective policy: matmul results are saved, everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """BLOCKS residual MLP blocks, each checkpointed per `how` (None, "full", "selective")."""

    def __init__(self, how):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.how = how

    def forward(self, x):
        for b in self.blocks:
            if self.how == "full":
                x = checkpoint(b, x, use_reentrant=False)
            elif self.how == "selective":
                ctx = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                x = checkpoint(b, x, use_reentrant=False, context_fn=ctx)
            else:
                x = b(x)
        return x


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)) for _ in range(STEPS)]


def _whole_steps(how, opt_name, backend, dump=None):
    """(losses, model, optimizer, programs per step) after STEPS whole steps from one start."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(how).train()
    opt = OPTIMIZERS[opt_name](model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    if backend is not None:
        options = {"cache_dir": None, **({"dump_dir": str(dump)} if dump else {})}
        step = torch.compile(step, backend=backend, options=options)
    tpuc.reset_stats()
    losses = [step(x, y) for x, y in _batches()]
    return losses, model, opt, tpuc.stats()["executions"] / STEPS


def _assert_same(got, want):
    (g_losses, g_model, g_opt, _), (w_losses, w_model, w_opt, _) = got, want
    for k, (a, b) in enumerate(zip(g_losses, w_losses, strict=True)):
        assert_close_scaled(a, b, f"loss of step {k}")
    for (name, a), b in zip(g_model.named_parameters(), w_model.parameters(), strict=True):
        assert_close_scaled(a.detach(), b.detach(), name)
    for a, b in zip(g_opt.state.values(), w_opt.state.values(), strict=True):
        for key in a:
            assert_close_scaled(a[key], b[key], f"optimizer state {key}")


def _dumped(dump: Path) -> dict:
    """The dump record (meta.json) of the last graph compiled: the steady step's (SGD's first
    step, with no momentum buffer yet, is a graph of its own)."""
    metas = sorted(dump.glob("*/meta.json"))
    assert metas, dump
    return json.loads(metas[-1].read_text())


def _matmuls(op_counts: dict) -> int:
    return sum(n for op, n in op_counts.items() if op in ("aten.mm.default", "aten.addmm.default"))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["full", "selective"])
def test_checkpointed_whole_step_matches_eager_and_recomputes(how, opt_name, tmp_path):
    want = _whole_steps(how, opt_name, None)
    got = _whole_steps(how, opt_name, "tpu", dump=tmp_path / how)
    assert got[3] == 1, f"{got[3]} programs per step"
    _assert_same(got, want)
    plain = _whole_steps(None, opt_name, "tpu", dump=tmp_path / "plain")
    _assert_same(plain, want)

    ck, base = _dumped(tmp_path / how), _dumped(tmp_path / "plain")
    # One barrier per connected piece of recomputation: one per block when whole blocks are
    # recomputed; a selective policy's saved matmuls may cut a block's into pieces. None
    # without checkpointing.
    barriers = ck["stablehlo_op_counts"].get("stablehlo.optimization_barrier", 0)
    assert barriers == BLOCKS if how == "full" else barriers >= BLOCKS, barriers
    assert "stablehlo.optimization_barrier" not in base["stablehlo_op_counts"]
    # The recomputation survives tpuc's passes: more ops after them than without.
    assert ck["ops"] > base["ops"], (ck["ops"], base["ops"])
    if how == "full":
        # Each block's first matmul at least is computed again for the backward.
        assert _matmuls(ck["op_counts"]) >= _matmuls(base["op_counts"]) + BLOCKS
    else:
        # Matmuls are saved: only what lies between them is recomputed.
        assert _matmuls(ck["op_counts"]) == _matmuls(base["op_counts"])
        assert ck["op_counts"]["aten.gelu.default"] > base["op_counts"]["aten.gelu.default"]


def test_split_road_recomputes_in_the_backward_graph(tmp_path):
    """The model compiled alone, `loss.backward()` run by the autograd engine: the forward
    graph hands fewer tensors to the backward with checkpointing, gradients equal eager."""
    saved = {}
    for how in (None, "full"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net(how).train()
        x, y = _batches()[0]
        F.mse_loss(model(x), y).backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        dump = tmp_path / str(how)
        compiled = torch.compile(model, backend="tpu", options={"cache_dir": None, "dump_dir": str(dump)})
        F.mse_loss(compiled(x), y).backward()
        for (name, p), w in zip(model.named_parameters(), want, strict=True):
            assert_close_scaled(p.grad, w, name)
        forward = [json.loads(m.read_text()) for m in dump.glob("*forward*/meta.json")]
        assert len(forward) == 1
        # Elements the forward returns: the output and what it saves for the backward.
        saved[how] = sum(functools.reduce(lambda a, b: a * b, o["shape"], 1) for o in forward[0]["outputs"])
    assert saved["full"] < saved[None], saved


class _Checkpointed(nn.Module):
    """A decoder layer under non-reentrant checkpointing, the way bench/bench_targets.py wraps
    Llama's layers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _llama_steps(how, backend, dump=None):
    """(losses, model, optimizer, programs per steady step) after STEPS steps (SGD with momentum:
    AdamW's update divides by the root of tiny second moments, and eager float32's own AdamW
    parameters are 3.5e-3 of their scale off float64's here, so it cannot hold two programs to
    1e-4) of a tiny transformers Llama whose decoder layers are checkpointed `how`: "wrapper"
    (each layer in `_Checkpointed`) or "transformers" (its own `activation_checkpointing_enable`)."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    lm = transformers.LlamaForCausalLM(cfg).train()
    if how == "wrapper":
        lm.model.layers = nn.ModuleList(_Checkpointed(layer) for layer in lm.model.layers)
    elif hasattr(lm, "activation_checkpointing_enable"):  # non-reentrant by default
        lm.activation_checkpointing_enable()
    else:  # transformers before 5.x
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.SGD(lm.parameters(), lr=0.05, momentum=0.9)

    def step(ids):
        opt.zero_grad(set_to_none=True)
        loss = lm(input_ids=ids, labels=ids, use_cache=False, return_dict=False)[0]
        loss.backward()
        opt.step()
        return loss.detach()

    if backend is not None:
        options = {"cache_dir": None, **({"dump_dir": str(dump)} if dump else {})}
        step = torch.compile(step, backend=backend, options=options)
    g = torch.Generator().manual_seed(1)
    losses, programs = [], []
    for _ in range(STEPS):
        tpuc.reset_stats()
        losses.append(step(torch.randint(0, 256, (2, 16), generator=g)))
        programs.append(tpuc.stats()["executions"])
    return losses, lm, opt, programs[-1]


@pytest.mark.parametrize("how", ["wrapper", "transformers"])
def test_checkpointed_llama_step_is_one_program_and_matches_eager(how, tmp_path):
    """A transformers Llama step with each decoder layer checkpointed is one program once the
    step asks for no KV cache (`use_cache=False`); the cache otherwise is written inside each
    checkpointed layer, a side effect Dynamo breaks the graph on (docs/training.md)."""
    want = _llama_steps(how, None)
    got = _llama_steps(how, "tpu", dump=tmp_path)
    assert got[3] == 1, f"{got[3]} programs per step"
    _assert_same(got, want)
    # The recomputation is kept: at least one barrier per checkpointed layer.
    barriers = _dumped(tmp_path)["stablehlo_op_counts"].get("stablehlo.optimization_barrier", 0)
    assert barriers >= 2, barriers
