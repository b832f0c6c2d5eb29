"""Compiled models saved to a file and loaded in a new process (`tpuc.save_compiled`,
`tpuc.load_compiled`, issue 4): the loading process traces nothing (no Dynamo, no AOTAutograd,
tpuc's backend is never called), compiles nothing when the cache holds the executables, uses the
parameters of the model it is given, and checks the saved guards. Each process runs
tests/cache_helpers/saved_model.py, which compares against eager PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpuc

TESTS = Path(__file__).resolve().parent
SAVED_MODEL = TESTS / "cache_helpers" / "saved_model.py"


def run(action: str, path: Path, cache: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, str(SAVED_MODEL), action, "--path", str(path), "--cache-dir", str(cache), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{action} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_saved_model_loads_in_new_process_without_tracing_or_compiling(tmp_path):
    path, cache = tmp_path / "preln.tpuc", tmp_path / "cache"
    saved = run("save", path, cache)
    assert saved["backend_calls"] == 1 and saved["stats"]["xla_compiles"] == 1
    assert path.stat().st_size > 0

    # Other weights than the saved process had: they are inputs, read from the model given.
    loaded = run("load", path, cache, "--seed", "1")
    assert loaded["backend_calls"] == 0, "loading must not trace (Dynamo + AOTAutograd call the backend)"
    assert loaded["stats"]["xla_compiles"] == 0
    assert loaded["stats"]["cache_hits_disk"] == 1
    assert loaded["max_abs_err"] <= 1e-5
    # A shape the saved guards do not cover is refused, not retraced or run wrongly.
    assert "GuardManager check failed" in loaded["other_shape"]
    assert "L['x'].size()" in loaded["other_shape"] or "size" in loaded["other_shape"]


def test_saved_training_graphs_give_eager_gradients(tmp_path):
    path, cache = tmp_path / "train.tpuc", tmp_path / "cache"
    saved = run("save", path, cache, "--train", "--model", "mlp")
    assert saved["stats"]["xla_compiles"] == 2  # forward and backward
    loaded = run("load", path, cache, "--train", "--model", "mlp", "--seed", "2")
    assert loaded["backend_calls"] == 0
    assert loaded["stats"]["xla_compiles"] == 0 and loaded["stats"]["cache_hits_disk"] == 2
    assert loaded["max_grad_err"] <= 1e-5


def test_load_with_an_empty_cache_compiles_and_is_correct(tmp_path):
    path = tmp_path / "conv.tpuc"
    run("save", path, tmp_path / "cache_a", "--model", "convnet")
    loaded = run("load", path, tmp_path / "cache_b", "--model", "convnet")
    assert loaded["backend_calls"] == 0
    assert loaded["stats"]["xla_compiles"] == 1
    assert loaded["max_abs_err"] <= 1e-5


# The tests above run their models in child processes without TPUC_ variables (the same under
# TPUC_DEBUG=discrete_device); this one runs here, so it is the one run again under it.
@pytest.mark.discrete_device
def test_save_and_load_a_function_in_process(tmp_path):
    def f(a, b):
        return torch.nn.functional.gelu(a @ b).sum(dim=0)

    a, b = torch.randn(5, 3), torch.randn(3, 4)
    path = tmp_path / "f.tpuc"
    with torch.no_grad():
        compiled = tpuc.save_compiled(f, path, (a, b), options={"cache_dir": str(tmp_path / "cache")})
        torch.testing.assert_close(compiled(a, b), f(a, b))
        loaded = tpuc.load_compiled(path)
        a2, b2 = torch.randn(5, 3), torch.randn(3, 4)
        torch.testing.assert_close(loaded(a2, b2), f(a2, b2))


def test_saving_with_a_mesh_is_refused(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match="mesh"):
        tpuc.save_compiled(
            model,
            tmp_path / "m.tpuc",
            (torch.randn(4, 4),),
            options={"mesh": {"shape": [1], "axes": ["data"]}, "cache_dir": None},
        )
