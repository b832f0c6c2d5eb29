"""PyTorch's caches carry tpuc's compiled graphs (autograd_cache.py, issue 41): after a
`backend="tpu"` compile, `torch.compiler.save_cache_artifacts()` returns the graphs (AOTAutograd's
cache entries, with tpuc's executables inside), and a new process that loads them, with an empty
tpuc cache folder and an empty AOTAutograd cache, traces no AOTAutograd, compiles nothing and
gives the same results, forward and backward. Each process runs
tests/cache_helpers/cache_artifacts.py, which compares against eager PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parent / "cache_helpers" / "cache_artifacts.py"


def run(action: str, path: Path, work: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUC_", "TORCHINDUCTOR_"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        TPUC_CACHE_DIR=str(work / "tpuc"),
        TORCHINDUCTOR_CACHE_DIR=str(work / "torch"),
    )
    cmd = [sys.executable, str(HELPER), action, "--path", str(path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{action} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("regions", [False, True], ids=["plain", "regions"])
def test_cache_artifacts_round_trip_compiles_nothing(tmp_path, regions):
    extra = ("--regions",) if regions else ()
    path = tmp_path / "artifacts.bin"
    saved = run("save", path, tmp_path / "first", *extra)
    assert saved["saved"] == {"aot_autograd": 1}
    assert saved["stats"]["xla_compiles"] > 0 and saved["stats"]["fallback_ops"] == {}
    assert saved["max_abs_err"] < 1e-4
    if regions:
        assert saved["stats"]["regions_compiled"] >= 2  # forward and backward region

    loaded = run("load", path, tmp_path / "second", *extra)  # empty caches of its own
    assert loaded["loaded"] == {"aot_autograd": 1}
    assert loaded["aot_autograd"].get("autograd_cache_hit") == 1
    assert "autograd_cache_miss" not in loaded["aot_autograd"]
    assert loaded["stats"]["xla_compiles"] == 0
    assert loaded["stats"]["cache_hits_disk"] == saved["stats"]["xla_compiles"]
    assert loaded["max_abs_err"] < 1e-4
    assert loaded["out_sum"] == saved["out_sum"]


@pytest.mark.parametrize("cache", [False, True], ids=["no_cache_dir", "cache_dir"])
def test_the_autograd_cache_key_is_computed_only_with_a_cache(tmp_path, monkeypatch, cache):
    """AOTAutograd's cache key (2.6-5.8 s for the first in a process, loaded host) is paid only
    when tpuc's cache is on: options={"cache_dir": None} asks for no cache."""
    import torch
    from torch._functorch._aot_autograd import autograd_cache as aot_cache

    keys = []
    real = aot_cache.autograd_cache_key

    def counted(*args, **kwargs):
        keys.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(aot_cache, "autograd_cache_key", counted)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    x = torch.randn(4, 17)
    options = {"cache_dir": str(tmp_path / "tpuc") if cache else None}
    with torch.no_grad():
        out = torch.compile(model, backend="tpu", options=options)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert len(keys) == (1 if cache else 0)
