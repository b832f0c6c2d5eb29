"""Source locations (issue 52): every StableHLO op a node becomes names the user's file and line
(`loc("node"("file.py":line:col))`), XLA's optimized HLO keeps them as `source_file` /
`source_line` metadata, the cache key ignores them, and PyTorch's structured trace
(`TORCH_TRACE`) holds tpuc's StableHLO as a named artifact."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import verify_stablehlo

import tpuc
from tpuc import cli, dump, runtime, structured_trace, targets

MODEL = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.lin(x)
        h = torch.relu(h) * 2
        h = self.norm(h)
        return torch.softmax(h, -1).sum(-1) + 1
"""


def _model_from_file(path: Path, name: str, blank_lines: int = 0):
    """`Net` from a module written to `path` (its code `blank_lines` lines further down)."""
    path.write_text("\n" * blank_lines + MODEL)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def _graph_folders(dump_dir: Path) -> list[Path]:
    return sorted(p for p in dump_dir.iterdir() if (p / "meta.json").is_file())


def test_dumped_ops_name_the_users_file_and_line(tmp_path, capsys):
    src = tmp_path / "loc_model_a.py"
    model = _model_from_file(src, "loc_model_a")
    x = torch.randn(4, 8)
    f = torch.compile(model, backend="tpu", options={"dump_dir": str(tmp_path / "dump")})
    out = f(x)
    out.sum().backward()  # the backward graph's ops name the forward's lines too
    torch.testing.assert_close(out, model(x))
    folders = _graph_folders(tmp_path / "dump")
    assert len(folders) == 2, folders
    lines = set(range(1, len(MODEL.splitlines()) + 1))
    for folder in folders:
        mlir = (folder / "stablehlo.mlir").read_text()
        verify_stablehlo(mlir)  # the located module is still real StableHLO
        ops = dump.op_locations(mlir)
        ours = [(op, line) for op, file, line in ops if file == str(src)]
        assert all(line in lines for _, line in ours), ours
        share = len(ours) / len(ops)
        assert share >= 0.8, f"{folder.name}: {len(ours)} of {len(ops)} ops name {src}"
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["stablehlo_ops_located"] >= len(ours)
        hlo = (folder / "optimized_hlo.txt").read_text()
        assert f'source_file="{src}"' in hlo, hlo[:2000]
        assert "source_line=" in hlo
    # `tpuc dump --lines`: the model's lines with what each graph made of them.
    assert cli.main(["dump", "--lines", str(tmp_path / "dump")]) == 0
    listing = capsys.readouterr().out
    assert f"{src}:12  h = self.lin(x)" in listing, listing
    assert re.search(r"g\d+_forward \[static\]: ", listing) and re.search(
        r"g\d+_backward \[static\]: ", listing
    )
    assert "stablehlo ops (" in listing and "hlo instructions" in listing, listing
    forward = (folders[0] / "stablehlo.mlir").read_text()
    # The node's name around the user's frame: loc("addmm"("…/loc_model_a.py":12:0)).
    assert '"addmm"(' in forward or "addmm" in forward


def test_same_graph_from_another_file_and_line_is_one_executable(tmp_path):
    # No disk cache and no AOTAutograd cache: the executable cache in memory decides.
    opts = {"dump_dir": str(tmp_path / "dump"), "cache_dir": None}
    a = _model_from_file(tmp_path / "loc_model_b1.py", "loc_model_b1")
    b = _model_from_file(tmp_path / "loc_model_b2.py", "loc_model_b2", blank_lines=7)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out_a = torch.compile(a, backend="tpu", options=opts)(x)
        out_b = torch.compile(b, backend="tpu", options=opts)(x)
        torch.testing.assert_close(out_a, a(x))
        torch.testing.assert_close(out_b, b(x))  # B's weights through A's executable
    stats = tpuc.stats()
    assert stats["xla_compiles"] == 1, stats
    assert stats["cache_hits_memory"] == 1, stats
    first, second = _graph_folders(tmp_path / "dump")
    meta_a = json.loads((first / "meta.json").read_text())
    meta_b = json.loads((second / "meta.json").read_text())
    assert meta_a["cache_key"] == meta_b["cache_key"]
    assert (meta_a["cache"], meta_b["cache"]) == ("miss", "memory")
    # Each StableHLO module names its own file, seven lines apart.
    files_a = {(f, n) for _, f, n in dump.op_locations((first / "stablehlo.mlir").read_text()) if f}
    files_b = {(f, n) for _, f, n in dump.op_locations((second / "stablehlo.mlir").read_text()) if f}
    assert {f for f, _ in files_a} == {str(tmp_path / "loc_model_b1.py")}
    assert {f for f, _ in files_b} == {str(tmp_path / "loc_model_b2.py")}
    assert {n + 7 for _, n in files_a} == {n for _, n in files_b}


CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
import tpuc

def f(x, w):
    return torch.relu(x @ w).sum(0)

x, w = torch.randn(4, 8), torch.randn(8, 3)
with torch.no_grad():
    out = torch.compile(f, backend="tpu")(x, w)
torch.testing.assert_close(out, f(x, w))
"""


def test_torch_trace_holds_the_stablehlo_artifact(tmp_path):
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace_dir)}
    child = textwrap.dedent(CHILD.format(tests=str(Path(__file__).parent)))
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = list(trace_dir.glob("*.log"))
    assert logs, list(trace_dir.iterdir())
    text = "\n".join(p.read_text() for p in logs)
    records = [
        json.loads(line[line.index("{") :])
        for line in text.splitlines()
        if '"artifact"' in line and "tpuc_" in line and "{" in line
    ]
    names = {r["artifact"]["name"] for r in records}
    stablehlo = [n for n in names if "tpuc" in n and "stablehlo" in n]
    assert stablehlo, names
    assert any(n.startswith("tpuc_compile_") for n in names), names
    assert any(n.startswith("tpuc_optimized_hlo_") for n in names), names
    # The payload follows its record: the module, with the child's own line in its locations.
    assert '"stablehlo.dot_general"' in text
    assert '"<string>":7:' in text or "<string>" in text


def test_no_trace_costs_nothing():
    # Off (no TORCH_TRACE): nothing of the executable is read, not even its text; checked here
    # (pytest's log capture handlers are not a trace) and in a plain process.
    assert not structured_trace.on()
    structured_trace.record("g1_forward", object())  # an object with no attributes at all
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TRACE"}
    check = (
        "import torch; from tpuc import structured_trace as s; "
        "assert not s.on(); s.record('g1_forward', object())"
    )
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


OUTER = """
import torch


def outer(a, b):
    c = a[:, None] * b[None, :]
    return c
"""


@pytest.mark.skipif(runtime._installed_plugin("tpu") is None, reason="libtpu is not installed")
def test_a_graph_too_big_for_the_chip_names_the_line_that_made_it(tmp_path):
    src = tmp_path / "loc_outer.py"
    src.write_text(OUTER)
    spec = importlib.util.spec_from_file_location("loc_outer", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        a, b = torch.zeros(65536 + 4096), torch.zeros(65536)  # a 17 GiB outer product
    options = {"target": "tpu:v5e:2x2", "cache_dir": str(tmp_path / "cache")}
    with pytest.raises(targets.DeviceMemoryError) as e:
        tpuc.precompile(module.outer, (a, b), options=options)
    message = str(e.value)
    assert f"17.00 GiB `mul` float32[69632, 65536] at {src}:6 (c = a[:, None] * b[None, :])" in message, (
        message
    )
