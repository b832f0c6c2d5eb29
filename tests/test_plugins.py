"""Plugin families: each gets only the client-create options its plugin accepts, a plugin whose
hardware is missing fails at once with an error naming the device (never a hang in libtpu), and
`tpuc doctor` reports the plugin that compiles would use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tpuc
from tpuc import runtime


@pytest.mark.parametrize(
    "name,family",
    [
        ("xla_cpu_pjrt.so", "cpu"),
        ("pjrt_c_api_cpu_plugin.so", "cpu"),
        ("xla_cuda_plugin.so", "cuda"),
        ("xla_rocm_plugin.so", "rocm"),
        ("libtpu.so", "tpu"),
        ("my_accelerator.so", "unknown"),
    ],
)
def test_plugin_family_from_the_file_name(name, family):
    assert runtime.plugin_family(Path("/opt/plugins") / name) == family


def test_each_family_gets_only_its_own_create_options():
    assert runtime.create_options("cpu", 2) == {"cpu_device_count": 2}
    assert runtime.create_options("cuda", 2) == {"preallocate": False}
    assert runtime.create_options("rocm", 2) == {"preallocate": False}
    assert runtime.create_options("tpu", 2) == {}
    assert runtime.create_options("unknown", 2) == {}
    assert runtime.create_options("cuda", 1, {"memory_fraction": 0.5}) == {
        "preallocate": False,
        "memory_fraction": 0.5,
    }


def _named_copy_of_cpu_plugin(tmp_path: Path, name: str) -> Path:
    """The CPU plugin under another family's file name (a link: nothing is copied)."""
    link = tmp_path / name
    link.symlink_to(runtime.resolve_plugin("cpu"))
    return link


@pytest.mark.parametrize(
    "name,device",
    [("libtpu.so", "a TPU"), ("xla_cuda_plugin.so", "an NVIDIA GPU"), ("xla_rocm_plugin.so", "an AMD GPU")],
)
def test_missing_hardware_fails_fast_and_names_the_device(tmp_path, name, device):
    family = runtime.plugin_family(Path(name))
    if runtime.hardware_present(family):
        pytest.skip(f"this machine has {device}")
    plugin = _named_copy_of_cpu_plugin(tmp_path, name)
    start = time.monotonic()
    with pytest.raises(tpuc.PjrtError, match=device):
        torch.compile(lambda x: x + 1, backend="tpu", options={"plugin": str(plugin)})(torch.ones(2))
    assert time.monotonic() - start < 60


def test_plugin_options_reach_the_plugin():
    assert runtime.get_runtime("cpu", None, {"cpu_device_count": 3}).device_count == 3
    with pytest.raises(ValueError, match="plugin_options"):
        torch.compile(lambda x: x + 1, backend="tpu", options={"plugin_options": {"a": object()}})(
            torch.ones(2)
        )


def test_doctor_reports_the_plugin_of_tpuc_pjrt_plugin(tmp_path):
    plugin = _named_copy_of_cpu_plugin(tmp_path, "renamed_cpu_plugin.so")
    env = {**os.environ, "TPUC_PJRT_PLUGIN": str(plugin)}
    out = subprocess.run(
        [sys.executable, "-m", "tpuc.cli", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert f"plugin (TPUC_PJRT_PLUGIN): {runtime.resolve_plugin('cpu')}" in out.stdout, out.stdout
    assert "installed plugins:\n  cpu: " in out.stdout, out.stdout
