"""Shared fixtures. Every StableHLO module that tpuc compiles during the test session is checked
by a real StableHLO verifier (the one in the torch-mlir wheel), in the test that emitted it."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The suite must not read or fill the user's cache (~/.cache/tpuc): counts of XLA compiles would
# depend on earlier runs. Subprocesses inherit this too.
os.environ["TPUC_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpuc-test-cache-")
# Nor PyTorch's caches, which hold tpuc's graphs too (AOTAutograd's cache, autograd_cache.py): a
# graph another run traced would load instead of compiling. Each test gets an empty one too
# (`_fresh_torch_cache`), so that what a test sees does not depend on the tests before it.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpuc-test-torch-cache-")

import tpuc  # noqa: E402
from tpuc import compiled_graph, env  # noqa: E402

# TPUC_DEBUG=discrete_device: the CPU plugin treated as a device with memory of its own (the GPU/TPU
# path); the few tests of what only host memory allows skip themselves.
DISCRETE = env.debug("discrete_device")


def host_kernels_without(*paths: str) -> str:
    """A TPUC_HOST_KERNELS value: what is on now, less `paths`."""
    on = [name for name, is_on in env.host_kernels().items() if is_on and name not in paths]
    return ",".join(on) or "off"


_verified: list[str] = []


def verify_stablehlo(text: str) -> None:
    """Parses and verifies `text` with StableHLO's own dialect registered (no unregistered ops)."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    with ir.Context() as ctx:
        _stablehlo.register_dialect(ctx)
        ctx.allow_unregistered_dialects = False
        module = ir.Module.parse(text)
        assert module.operation.verify(), "StableHLO verifier rejected the module"


@pytest.fixture(autouse=True, scope="session")
def _verify_every_module():
    original = compiled_graph.CompiledGraph._compile

    def compile_and_verify(self, bindings, key, **kwargs):
        entry = original(self, bindings, key, **kwargs)
        verify_stablehlo(entry[0].mlir)
        _verified.append(self.name)
        return entry

    compiled_graph.CompiledGraph._compile = compile_and_verify
    yield
    compiled_graph.CompiledGraph._compile = original


@pytest.fixture(autouse=True)
def _fresh_torch_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torch-cache")))


@pytest.fixture
def verified_modules():
    """Names of the graphs verified so far (tests can check the hook saw their modules)."""
    return _verified


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    tpuc.reset_stats()
    yield
    torch._dynamo.reset()


# `pytest --stand-in` (make test's third pass): every compile with backend "tpu" that names no
# target compiles for a TPU slice and runs through its CPU stand-in (options {"target":
# STAND_IN_TARGET, "stand_in": "cpu"}, docs/tpu-target.md): the tests marked `stand_in` then
# check against eager exactly what the TPU would run. Needs libtpu.
STAND_IN_TARGET = "tpu:v5e:2x2"
# XLA compiles per executable a test sees: through the stand-in, the target's and this machine's.
COMPILES_PER_EXECUTABLE = 1  # 2 with --stand-in (pytest_configure)


def pytest_addoption(parser):
    parser.addoption(
        "--stand-in",
        action="store_true",
        help=f"compile for {STAND_IN_TARGET} and run through the CPU stand-in (tests marked stand_in)",
    )


def pytest_configure(config):
    global COMPILES_PER_EXECUTABLE
    if not config.getoption("--stand-in"):
        return
    COMPILES_PER_EXECUTABLE = 2
    from tpuc import options as options_mod

    parse = options_mod.parse

    def through_stand_in(options=None, mode=None):
        options = dict(options or {})
        if "target" not in options:
            options.update(target=STAND_IN_TARGET, stand_in="cpu")
        return parse(options, mode)

    options_mod.parse = through_stand_in
