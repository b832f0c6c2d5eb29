"""Consecutive calls of one `@nested_compile_region` block as one loop (`regions="loop"`,
block_loops.py): one `stablehlo.while` over the blocks' stacked parameters, forward and
backward, equal to eager (every layer's `.grad` too); chains that cannot be a loop keep their
calls; writes to a layer's parameters between calls are seen."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import PreLNBlock
from test_regions import MarkedBlock, Stack
from torch import nn

import tpuc
from tpuc import runtime

LOOP = {"cache_dir": None, "regions": "loop", "fallback": "error"}


def _modules(dump_dir) -> list[str]:
    return [p.read_text() for p in sorted(dump_dir.glob("*/stablehlo.mlir"))]


def _infer(model, x, dump_dir=None, options=LOOP):
    torch._dynamo.reset()
    tpuc.reset_stats()
    opts = {**options, **({"dump_dir": str(dump_dir)} if dump_dir else {})}
    with torch.no_grad():
        out = torch.compile(model, backend="tpu", options=opts)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    return tpuc.stats()


def test_marked_blocks_are_one_while_loop(tmp_path):
    torch.manual_seed(0)
    stats = _infer(Stack(5), torch.randn(2, 24, 64), tmp_path)
    assert stats["regions_looped"] == 1 and stats["regions_compiled"] == 0
    assert stats["xla_compiles"] == stats["executions"] == 1
    (text,) = _modules(tmp_path)
    assert text.count('"stablehlo.while"') == 1, text


def _train(model, x, backend, options=None):
    model = copy.deepcopy(model)
    fn = model if backend is None else torch.compile(model, backend=backend, options=options)
    out = fn(x)
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_training_loops_forward_and_backward_and_every_layer_gets_its_grad(tmp_path):
    torch.manual_seed(0)
    model = Stack(5)
    x = torch.randn(2, 17, 64)
    torch._dynamo.reset()
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
        out, grads = _train(model, x, "tpu", {**LOOP, "dump_dir": str(tmp_path)})
    stats = tpuc.stats()
    assert stats["regions_looped"] == 2 and stats["xla_compiles"] == 2  # forward, backward
    assert all(t.count('"stablehlo.while"') == 1 for t in _modules(tmp_path))
    ref_out, ref_grads = _train(model, x, None)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None, name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


class _OtherMarked(PreLNBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x):
        return super().forward(x) * 0.5


class _Mixed(nn.Module):
    """Marked blocks of two kinds: A A B A A A (two chains of one region, broken by another)."""

    def __init__(self, d=64):
        super().__init__()
        kinds = [MarkedBlock, MarkedBlock, _OtherMarked, MarkedBlock, MarkedBlock, MarkedBlock]
        self.blocks = nn.ModuleList(k(d) for k in kinds)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_chain_broken_by_another_block_is_two_loops(tmp_path):
    torch.manual_seed(0)
    stats = _infer(_Mixed(), torch.randn(1, 20, 64), tmp_path)
    assert stats["regions_looped"] == 2
    # the lone B (inlined by PyTorch or by tpuc) joins the one program
    assert stats["xla_compiles"] == 1
    (text,) = _modules(tmp_path)
    assert text.count('"stablehlo.while"') == 2, text


class _Widths(nn.Module):
    """One marked block class at two widths: consecutive calls whose weights differ in shape
    (Dynamo traces one region per width)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = MarkedBlock(64), MarkedBlock(64)
        self.up = nn.Linear(64, 128)
        self.c, self.d = MarkedBlock(128), MarkedBlock(128)

    def forward(self, x):
        return self.d(self.c(self.up(self.b(self.a(x)))))


def test_blocks_whose_weights_differ_in_shape_are_not_one_loop(tmp_path):
    torch.manual_seed(0)
    stats = _infer(_Widths(), torch.randn(1, 12, 64), tmp_path)
    # Each width is its own chain of two; never one loop across the widths.
    (text,) = _modules(tmp_path)
    assert text.count('"stablehlo.while"') == stats["regions_looped"] <= 2, text


def test_a_chain_with_a_use_between_the_calls_keeps_its_calls():
    """An intermediate activation read outside the chain (a skip connection summed later) is a
    per-step output of the loop: still exact."""

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(MarkedBlock(64) for _ in range(4))

        def forward(self, x):
            hs = []
            for b in self.blocks:
                x = b(x)
                hs.append(x)
            return x + hs[1] * 0.25

    torch.manual_seed(0)
    stats = _infer(Skip(), torch.randn(1, 10, 64))
    assert stats["fallback_ops"] == {}


def test_writes_to_parameters_between_calls_are_seen():
    """The stacked weights are made from every layer's current parameters at each call: an
    in-place write, an optimizer step and `load_state_dict` are all seen."""
    torch.manual_seed(0)
    model = Stack(4)
    x = torch.randn(1, 16, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu", options=LOOP)
    tpuc.reset_stats()
    per_block = len(list(model.blocks[0].parameters()))
    with torch.no_grad():
        for _ in range(3):  # parameters become resident after the second call
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["block_stacks_made"] == per_block  # once, then kept
        model.blocks[2].fc2.weight.mul_(-2.0)
        model.blocks[0].ln1.bias.add_(0.5)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert tpuc.stats()["block_stacks_made"] == per_block + 2  # the two written, again
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        other = Stack(4)
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(compiled(x), other(x), rtol=1e-5, atol=1e-5)


_needs_libtpu = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None, reason="libtpu is not installed (scripts/setup.sh installs it)"
)


@_needs_libtpu
def test_for_a_tpu_target_the_marked_model_is_one_executable_whatever_the_depth():
    """The target's default (`regions="auto"`): the blocks are one loop, the model one
    executable, forward and backward."""
    for depth in (3, 6):
        torch.manual_seed(0)
        torch._dynamo.reset()
        tpuc.reset_stats()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
            report = tpuc.precompile(
                Stack(depth, d=32),
                [torch.randn(1, 16, 32)],
                training=True,
                options={"target": "tpu:v5e:1x1", "cache_dir": None},
            )
        assert report["executables"] == 2, report["per_graph"]  # forward, backward
        assert tpuc.stats()["regions_looped"] == 2 and tpuc.stats()["regions_compiled"] == 0


class _Dropped(PreLNBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x):
        return nn.functional.dropout(super().forward(x), 0.25, self.training)


def test_a_block_that_draws_random_numbers_is_not_a_loop_forward():
    """Each layer's dropout draws its own mask: the forward's calls stay calls (no fallback to
    PyTorch); the backward, which reads the saved masks, is a loop."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Dropped(32) for _ in range(4)))
    torch._dynamo.reset()
    tpuc.reset_stats()
    out = torch.compile(model, backend="tpu", options=LOOP)(torch.randn(1, 8, 32))
    out.square().sum().backward()
    stats = tpuc.stats()
    assert stats["fallback_ops"] == {}
    assert stats["regions_looped"] == 1  # the backward
    assert all(p.grad is not None for p in model.parameters())


def test_a_loop_with_a_bucketed_sequence(tmp_path):
    # The blocks take the bucketed length as a size every call shares: still one loop, one
    # executable per bucket (16 and 32), exact at every real length.
    torch.manual_seed(0)
    model = Stack(4)
    torch._dynamo.reset()
    tpuc.reset_stats()
    fn = torch.compile(model, backend="tpu", options={**LOOP, "cache_dir": str(tmp_path)})
    with torch.no_grad():
        for t in (9, 13, 20):
            x = torch.randn(2, t, 64)
            torch._dynamo.mark_dynamic(x, 1, min=2, max=32)
            torch.testing.assert_close(fn(x), model(x), rtol=1e-5, atol=1e-5)
    stats = tpuc.stats()
    assert stats["regions_looped"] == 1 and stats["xla_compiles"] == 2
