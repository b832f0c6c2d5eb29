"""Blocks marked with `@torch.compiler.nested_compile_region` (regions.py): compiled by tpuc,
once per distinct region (option `regions="executables"`) or inlined into one executable (the CPU
plugin's default), and equal to eager and aot_eager, forward and backward."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import PreLNBlock
from torch import nn

import tpuc
from tpuc import runtime


class MarkedBlock(PreLNBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x):
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, depth: int, block=MarkedBlock, d: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(depth))
        self.head = nn.Linear(d, 17)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train_step(model, backend, x, options=None):
    model = copy.deepcopy(model)
    fn = model if backend is None else torch.compile(model, backend=backend, options=options)
    out = fn(x)
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


_EXECUTABLES = {"cache_dir": None, "regions": "executables"}
_MODES = ("executables", "inline")


@pytest.mark.parametrize("mode", _MODES)
def test_marked_blocks_train_like_eager_and_aot_eager(mode):
    torch.manual_seed(0)
    model = Stack(4)
    x = torch.randn(2, 33, 64)
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback warns
        warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
        out, grads = _train_step(model, "tpu", x, {"cache_dir": None, "regions": mode})
    stats = tpuc.stats()
    assert stats["fallback_ops"] == {}
    # One forward and one backward region (PyTorch may trace a second backward region for a
    # call site whose incoming gradient has another layout).
    assert 2 <= stats[f"regions_{'compiled' if mode == 'executables' else 'inlined'}"] <= 4
    if mode == "inline":
        assert stats["regions_compiled"] == 0 and stats["xla_compiles"] == 2  # forward, backward
    torch._dynamo.reset()
    for backend in (None, "aot_eager"):
        ref_out, ref_grads = _train_step(model, backend, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _inference_compiles(depth: int, options=None) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Stack(depth)
    x = torch.randn(1, 40, 64)
    tpuc.reset_stats()
    with torch.no_grad():
        out = torch.compile(model, backend="tpu", options=options or _EXECUTABLES)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    return tpuc.stats()


def test_region_compiled_once_whatever_the_depth():
    """The block is lowered and XLA-compiled once: 8 blocks compile what 2 do."""
    two, eight = _inference_compiles(2), _inference_compiles(8)
    assert two["fallback_ops"] == eight["fallback_ops"] == {}
    assert two["regions_compiled"] == eight["regions_compiled"] == 1
    # Executables obtained (compiled, or found in memory: the second model is the first's).
    obtained = [s["xla_compiles"] + s["cache_hits_memory"] + s["cache_hits_disk"] for s in (two, eight)]
    assert obtained[0] == obtained[1] == 2  # the region, the head
    assert eight["graphs_compiled"] == two["graphs_compiled"]
    # Every block ran: one launch per call site (and the graph around them).
    assert eight["executions"] - two["executions"] == 6


def test_on_the_cpu_plugin_regions_are_inlined_into_one_executable():
    """The CPU plugin's default (`regions="auto"`): one executable, as for the unmarked model (its
    steady calls), the blocks traced once by Dynamo and AOTAutograd."""
    stats = _inference_compiles(3, {"cache_dir": None})
    assert stats["regions_inlined"] == 1 and stats["regions_compiled"] == 0
    assert stats["xla_compiles"] == stats["executions"] == 1
    assert stats["fallback_ops"] == {}


def test_unmarked_blocks_have_no_regions():
    torch.manual_seed(0)
    model = Stack(2, block=PreLNBlock)
    x = torch.randn(1, 9, 64)
    tpuc.reset_stats()
    with torch.no_grad():
        torch.compile(model, backend="tpu", options={"cache_dir": None})(x)
    assert tpuc.stats()["regions_compiled"] == 0


@pytest.mark.parametrize("mode", _MODES)
def test_a_write_to_one_blocks_weight_is_seen(mode):
    """The region's executable serves every block: each call site reads its own block's
    parameters, and their current values."""
    torch.manual_seed(0)
    model = Stack(3)
    compiled = torch.compile(model, backend="tpu", options={"cache_dir": None, "regions": mode})
    x = torch.randn(1, 17, 64)
    with torch.no_grad():
        for _ in range(3):  # parameters become resident on the CPU plugin after the second call
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        model.blocks[1].fc2.weight.mul_(-2.0)
        model.blocks[2].ln1.bias.add_(0.5)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 17, 64])
def test_dynamic_sequence_length(n):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Stack(3)
    x = torch.randn(2, 40, 64)
    torch._dynamo.mark_dynamic(x, 1, min=1, max=64)
    compiled = torch.compile(model, backend="tpu", options=_EXECUTABLES)
    tpuc.reset_stats()
    with torch.no_grad():
        compiled(x)
        y = torch.randn(2, n, 64)
        torch.testing.assert_close(compiled(y), model(y), rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["fallback_ops"] == {}


_V5E = "tpu:v5e:2x2"
_needs_libtpu = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None, reason="libtpu is not installed (scripts/setup.sh installs it)"
)


@_needs_libtpu
def test_a_region_is_one_executable_for_a_tpu_target_whatever_the_depth(tmp_path):
    """On the target path (options={"target": ...}) with `regions="executables"` each distinct
    region is one XLA:TPU executable: 8 marked blocks compile what 4 do (the region and the graph around it), forward
    and backward. (With 2 blocks PyTorch inlines the regions of a training graph.)"""
    seen = {}
    for depth in (4, 8):
        torch.manual_seed(0)
        torch._dynamo.reset()
        tpuc.reset_stats()
        model = Stack(depth)
        x = torch.randn(2, 24, 64)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
            report = tpuc.precompile(
                model,
                [x],
                training=True,
                options={"target": _V5E, "regions": "executables", "cache_dir": str(tmp_path / str(depth))},
            )
        seen[depth] = sorted(g["name"].split(".", 1)[-1] for g in report["per_graph"])
        assert report["compiled"] == report["executables"] == tpuc.stats()["xla_compiles"]
        assert 2 <= tpuc.stats()["regions_compiled"] <= 4  # forward and backward region(s)
        # Every executable is a TPU one: nothing of the model runs in PyTorch between them but
        # the launches.
        assert all(g["devices"] == 1 and g["flops"] > 0 for g in report["per_graph"])
    assert seen[4] == seen[8], seen
    assert any("subgraph" in name for name in seen[8]), seen


@_needs_libtpu
def test_on_a_device_the_target_path_runs_regions_and_matches_eager():
    """What a host with the target's devices runs (the CPU plugin standing in for the TPU): the
    same split graphs, forward and backward, equal to eager."""
    on_cpu = "tpu"
    options = {"target": _V5E, "stand_in": "cpu", "cache_dir": None, "regions": "executables"}

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Stack(3)
    x = torch.randn(2, 17, 64)
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
        out, grads = _train_step(model, on_cpu, x, options)
    assert 2 <= tpuc.stats()["regions_compiled"] <= 4
    assert tpuc.stats()["fallback_ops"] == {}
    ref_out, ref_grads = _train_step(model, None, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


class _Pair(nn.Module):
    """A region of two regions."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.a, self.b = MarkedBlock(d), MarkedBlock(d)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("mode", _MODES)
def test_regions_in_regions_match_eager(mode):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Sequential(_Pair(), _Pair(), nn.Linear(64, 5))
    x = torch.randn(2, 17, 64)
    tpuc.reset_stats()
    with torch.no_grad():
        out = torch.compile(model, backend="tpu", options={"cache_dir": None, "regions": mode})(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    stats = tpuc.stats()
    assert stats["fallback_ops"] == {}
    if mode == "inline":
        assert stats["regions_inlined"] >= 1 and stats["xla_compiles"] == 1
    else:
        assert stats["regions_compiled"] >= 1
