"""Debugging dumps (`dump_dir`, docs/api.md "Dumps") and `tpuc dump DIR` / `tpuc dump --diff A B`.

Every file docs/api.md lists must be there and hold what it says: the FX graph, the IR before and after
each pass, the StableHLO module, XLA's optimized HLO (`HloModule ...`), meta.json with its fields,
and graph.svg (valid SVG naming the ops). The CLI is run as a separate process, as a user runs it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from tpuc import dump

TPUC_CLI = Path(sys.executable).parent / "tpuc"
SVG_NS = "{http://www.w3.org/2000/svg}"


class MLP(torch.nn.Module):
    def __init__(self, act=torch.relu, hidden=16):
        super().__init__()
        self.l1 = torch.nn.Linear(8, hidden)
        self.l2 = torch.nn.Linear(hidden, 4)
        self.act = act

    def forward(self, x):
        return torch.softmax(self.l2(self.act(self.l1(x)) * 2.0), dim=-1).sum(0)


def _compile_dump(folder: Path, model=None, batch=3, train=False) -> list[Path]:
    torch.manual_seed(0)
    model = model or MLP()
    x = torch.randn(batch, 8)
    compiled = torch.compile(model, backend="tpu", options={"dump_dir": str(folder), "cache_dir": None})
    with torch.no_grad() if not train else torch.enable_grad():
        out = compiled(x)
    if train:
        out.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    return sorted(p for p in folder.iterdir() if p.is_dir())


def _cli(*argv: str) -> subprocess.CompletedProcess:
    cmd = [str(TPUC_CLI)] if TPUC_CLI.exists() else [sys.executable, "-m", "tpuc.cli"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def mlp_dump(tmp_path_factory) -> Path:
    """One inference graph of MLP, dumped."""
    d = tmp_path_factory.mktemp("dump_mlp")
    folders = _compile_dump(d)
    assert len(folders) == 1, folders
    return folders[0]


def test_dump_holds_every_file_the_api_lists(mlp_dump):
    f = mlp_dump
    assert re.fullmatch(r"\d{8}-\d{6}_\d{4}_g\d+_forward_static", f.name), f.name
    fx = (f / "fx_graph.txt").read_text()
    assert "torch.ops.aten.addmm.default" in fx and "def forward" in fx
    imported = (f / "ir_0_imported.txt").read_text()
    assert "aten.addmm.default" in imported and "return (" in imported
    after = sorted(f.glob("ir_*_after_*.txt"))
    assert after, "no IR after a pass"
    assert all("aten.addmm.default" in p.read_text() for p in after)
    spec = (f / "ir_specialized.txt").read_text()
    assert "f32" in spec or "float32" in spec
    mlir = (f / "stablehlo.mlir").read_text()
    assert mlir.count('"stablehlo.dot_general"') == 2, mlir
    hlo = (f / "optimized_hlo.txt").read_text()
    assert hlo.startswith("HloModule "), hlo[:200]
    assert "ENTRY %" in hlo and "ROOT %" in hlo
    # XLA's optimized program: the two matmuls are still there as dots, in fused HLO
    assert len(re.findall(r"= f32\[[0-9,]+\]\{[0-9,]+\} dot\(", hlo)) == 2, hlo
    assert "fusion(" in hlo and "kind=kLoop" in hlo
    assert (f / "graph.dot").read_text().startswith("digraph tpuc {")


def test_graph_svg_is_valid_and_names_the_ops(mlp_dump):
    assert shutil.which("dot"), "Graphviz `dot` is missing: run scripts/setup.sh (apt package graphviz)"
    svg_text = (mlp_dump / "graph.svg").read_text()
    root = ET.fromstring(svg_text)  # well-formed XML
    assert root.tag == f"{SVG_NS}svg"
    texts = [t.text or "" for t in root.iter(f"{SVG_NS}text")]
    for op in ("addmm.default", "relu.default", "mul.Tensor", "_softmax.default", "sum.dim_IntList"):
        assert op in texts, (op, texts)
    # shapes and dtypes on the nodes; inputs and outputs drawn as such
    assert "f32[3,16]" in texts and "f32[3,8]" in texts
    classes = {g.get("class") for g in root.iter(f"{SVG_NS}g")}
    assert {"node input", "node output", "node matmul", "node elementwise", "node reduction"} <= classes, (
        classes
    )
    # addmm -> relu -> mul -> addmm is the MLP unit lowered as one composite, drawn as a labelled
    # cluster (so is the softmax); the legend counts kinds
    assert any(t.startswith("composite tpuc.mlp (") for t in texts), texts
    assert any(t.startswith("composite tpuc.softmax (") for t in texts), texts
    assert "matmul/conv (2)" in texts


def test_meta_json_fields(mlp_dump):
    m = json.loads((mlp_dump / "meta.json").read_text())
    assert m["format"] == dump.FORMAT
    assert re.fullmatch(r"[0-9a-f]{64}", m["cache_key"])
    assert m["cache"] == "miss"
    assert re.fullmatch(r"g\d+_forward", m["graph"])
    assert m["bindings"] == {}
    # parameters and the input, in graph order; one f32[4] result
    assert {"shape": [3, 8], "dtype": "float32"} in m["inputs"]
    assert {"shape": [16, 8], "dtype": "float32"} in m["inputs"]
    assert m["outputs"] == [{"shape": [4], "dtype": "float32"}]
    assert m["options"]["dump_dir"] == str(mlp_dump.parent)
    assert "precision" in m["options"]
    t = m["timings"]
    assert t["lower_seconds"] > 0 and t["compile_seconds"] > 0
    assert t["xla_compile_seconds"] == t["compile_seconds"]  # a miss: PJRT compiled it
    assert m["passes"] and all(p["ops_before"] >= p["ops_after"] > 0 for p in m["passes"])
    for p in m["passes"]:
        assert sum(p["op_counts_after"].values()) == p["ops_after"], p
    assert sum(m["imported_op_counts"].values()) == m["passes"][0]["ops_before"]
    assert m["passes"][-1]["op_counts_after"] == m["op_counts"]
    assert m["op_counts"]["aten.addmm.default"] == 2
    assert m["ops"] == sum(m["op_counts"].values())
    counts = m["stablehlo_op_counts"]
    mlir = (mlp_dump / "stablehlo.mlir").read_text()
    assert counts["stablehlo.dot_general"] == 2
    assert counts["stablehlo.exponential"] == mlir.count('"stablehlo.exponential"') >= 1
    # main, and one private function per distinct composite decomposition
    decompositions = set(re.findall(r"decomposition = @([\w.]+)", mlir))
    assert counts["func.func"] == 1 + len(decompositions) and counts["builtin.module"] == 1
    assert m["stablehlo_ops"] == sum(v for k, v in counts.items() if k not in dump.STRUCTURAL_OPS)
    assert m["optimized_hlo"] == "optimized_hlo.txt"
    pic = m["graph_picture"]
    assert pic["svg"] == "graph.svg" and pic["dot"] == "graph.dot" and pic["clusters"] is True
    assert pic["nodes"] >= 12 and pic["render_seconds"] < 10


def test_training_dumps_sort_in_compile_order(tmp_path):
    folders = _compile_dump(tmp_path, train=True)
    assert [re.sub(r".*_(g\d+_)", "", f.name) for f in folders] == ["forward_static", "backward_static"]
    for f in folders:
        assert (f / "graph.svg").stat().st_size > 1000
        assert (f / "optimized_hlo.txt").read_text().startswith("HloModule ")


def test_stablehlo_op_counts_parse_generic_form():
    text = """"builtin.module"() ({
  "func.func"() <{sym_name = "main"}> ({
  ^bb0(%arg0: tensor<2xf32>):
    %0 = "stablehlo.add"(%arg0, %arg0) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    %1:2 = "stablehlo.sort"(%0, %0) ({
      "stablehlo.return"(%x) : (tensor<i1>) -> ()
    }) {dimension = 0 : i64} : (tensor<2xf32>, tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>)
    %2 = "stablehlo.dot_general"(%0, %0) {dot_dimension_numbers = #stablehlo.dot<>} : () -> ()
    "func.return"(%2) : (tensor<2xf32>) -> ()
  }) : () -> ()
}) : () -> ()
"""
    assert dump.stablehlo_op_counts(text) == {
        "builtin.module": 1,
        "func.func": 1,
        "func.return": 1,
        "stablehlo.add": 1,
        "stablehlo.dot_general": 1,
        "stablehlo.return": 1,
        "stablehlo.sort": 1,
    }


def test_no_graphviz_writes_dot_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(dump.shutil, "which", lambda name: None)
    (f,) = _compile_dump(tmp_path)
    assert not (f / "graph.svg").exists()
    assert (f / "graph.dot").read_text().startswith("digraph tpuc {")
    pic = json.loads((f / "meta.json").read_text())["graph_picture"]
    assert pic["svg"] is None and "Graphviz" in pic["note"] and "graph.dot" in pic["note"]


def test_big_graph_is_skipped_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(dump, "SVG_MAX_NODES", 5)
    (f,) = _compile_dump(tmp_path)
    assert not (f / "graph.svg").exists() and (f / "graph.dot").exists()
    note = json.loads((f / "meta.json").read_text())["graph_picture"]["note"]
    assert "above the limit of 5" in note and "tpuc.dump.SVG_MAX_NODES" in note


def test_large_graph_settings_and_dot_timeout(tmp_path, monkeypatch):
    # past the cluster limit: no clusters, cheaper dot flags, still an SVG
    monkeypatch.setattr(dump, "SVG_CLUSTER_MAX_NODES", 5)
    (f,) = _compile_dump(tmp_path / "big")
    pic = json.loads((f / "meta.json").read_text())["graph_picture"]
    assert pic["svg"] == "graph.svg" and pic["clusters"] is False and "not drawn as clusters" in pic["note"]
    assert "subgraph cluster" not in (f / "graph.dot").read_text()
    ET.fromstring((f / "graph.svg").read_text())
    # dot running past the timeout: no SVG, a note
    monkeypatch.setattr(dump, "SVG_TIMEOUT", 1e-4)
    (f,) = _compile_dump(tmp_path / "slow")
    pic = json.loads((f / "meta.json").read_text())["graph_picture"]
    assert not (f / "graph.svg").exists() and pic["svg"] is None
    assert "dot took longer than" in pic["note"] and "tpuc.dump.SVG_TIMEOUT" in pic["note"]


def test_cli_dump_summarizes(mlp_dump):
    m = json.loads((mlp_dump / "meta.json").read_text())
    proc = _cli("dump", str(mlp_dump.parent))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    line = lines[0]
    assert line.startswith(f"{mlp_dump.name}: graph {m['graph']} [static]"), line
    assert f"| {m['stablehlo_ops']} stablehlo ops (" in line
    # the most frequent op kind is listed first (composites hide the dot_generals of this MLP)
    counts = dump._hlo_counts(m)
    (top, n), *_ = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    assert f"({top} {n}, " in line, line
    assert "f32[3,8]" in line and "-> f32[4]" in line
    # miss, or memory where this worker compiled the same module before (tests share a process)
    assert m["cache"] in ("miss", "memory") and f"cache {m['cache']} {m['cache_key'][:16]}" in line
    assert re.search(r"lower \d+\.\d{3}s compile \d+\.\d{3}s", line), line
    assert lines[1].startswith(f"1 graph folder(s), {m['stablehlo_ops']} stablehlo ops")
    # one graph folder works too
    proc = _cli("dump", str(mlp_dump))
    assert proc.returncode == 0 and proc.stdout.startswith(f"{mlp_dump.name}: graph ")


def test_cli_dump_rejects_a_folder_that_is_not_a_dump(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = _cli("dump", str(tmp_path))
    assert proc.returncode == 2
    assert "not a tpuc dump" in proc.stderr and str(tmp_path) in proc.stderr
    assert proc.stdout == ""
    proc = _cli("dump", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr
    proc = _cli("dump", "--diff", str(tmp_path))
    assert proc.returncode == 2 and "give two dump folders" in proc.stderr


def test_cli_dump_diff(tmp_path, mlp_dump):
    same = _compile_dump(tmp_path / "same")
    gelu = _compile_dump(tmp_path / "gelu", model=MLP(act=torch.nn.functional.gelu))
    wider = _compile_dump(tmp_path / "batch5", batch=5)

    proc = _cli("dump", "--diff", str(mlp_dump.parent), str(same[0].parent))
    assert proc.returncode == 0, proc.stderr
    assert "same module" in proc.stdout and "DIFFERENT" not in proc.stdout, proc.stdout
    assert "1 graph(s) compared: 0 different, 1 same" in proc.stdout

    proc = _cli("dump", "--diff", str(mlp_dump.parent), str(gelu[0].parent))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "DIFFERENT" in out and "1 graph(s) compared: 1 different, 0 same" in out, out
    a = json.loads((mlp_dump / "meta.json").read_text())["stablehlo_op_counts"]
    b = json.loads((gelu[0] / "meta.json").read_text())["stablehlo_op_counts"]
    # every StableHLO op kind whose count changed is reported with both counts
    changed = {k for k in a.keys() | b.keys() if a.get(k, 0) != b.get(k, 0)} - set(dump.STRUCTURAL_OPS)
    assert changed, (a, b)
    for k in changed:
        op, x, y = k.removeprefix("stablehlo."), a.get(k, 0), b.get(k, 0)
        assert f"\n    {op}: {x} -> {y} ({y - x:+d})\n" in out, out
    assert sum(
        1 for line in out.splitlines() if re.fullmatch(r"    [a-z_]+: \d+ -> \d+ \([+-]\d+\)", line)
    ) == len(changed)
    assert "aten.relu.default: 1 -> 0 (-1)" in out and "aten.gelu.default: 0 -> 1 (+1)" in out
    assert "stablehlo.mlir diff:" in out and "\n    +" in out and "\n    -" in out
    assert "timings: lower " in out

    # two graph folders given directly; shapes differ
    proc = _cli("dump", "--diff", str(mlp_dump), str(wider[0]))
    assert proc.returncode == 0, proc.stderr
    assert "\n  inputs: 5 -> 5\n    input 2: f32[3,8] -> f32[5,8]\n" in proc.stdout, proc.stdout
    assert "input 0:" not in proc.stdout  # the weights did not change
    assert "cache key: " in proc.stdout


def test_fx_graph_to_dot_keeps_symbolic_sizes():
    from tpuc import _native

    wire = {
        "nodes": [
            {
                "name": "x",
                "op": "placeholder",
                "target": "x",
                "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}},
            },
            {
                "name": "relu",
                "op": "call_function",
                "target": "aten.relu.default",
                "args": [{"node": "x"}],
                "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}},
            },
            {"name": "output", "op": "output", "target": "output", "args": [[{"node": "relu"}]]},
        ]
    }
    dot = _native.FxGraph.from_json(json.dumps(wire)).to_dot("t", clusters=False, legend=False)
    assert dot.startswith("digraph tpuc {") and 'label="t"' in dot
    assert 'label="relu.default\\nf32[s0,4]"' in dot and 'label="x\\nf32[s0,4]"' in dot
    assert "out0 [shape=house" in dot and "legend" not in dot


def test_graph_picture_groups_each_composite_unit(tmp_path):
    """With the fusion passes on, every unit lowering emits as a `stablehlo.composite` is its own
    labelled cluster in graph.dot / graph.svg (the picture shows what XLA gets as one op). The
    fused CPU attention is one only without the host attention kernel, which lowers it in the
    main function (it reads q, k and v where they lie there): the picture follows lowering."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import make

    from tpuc import runtime

    host_attention = runtime.get_runtime(None).host_attention
    model, (x,) = make("preln", batch=2)
    compiled = torch.compile(model, backend="tpu", options={"dump_dir": str(tmp_path), "cache_dir": None})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    dot_text = (folder / "graph.dot").read_text()
    labels = re.findall(r'label="composite tpuc\.(\w+) \((\d+) ops\)"', dot_text)
    names = {name for name, _ in labels}
    assert {"layer_norm", "mlp"} <= names, labels
    assert ("attention" in names) != host_attention, labels
    assert all(int(n) >= 1 for _, n in labels)
    hlo = (folder / "stablehlo.mlir").read_text()
    assert hlo.count('"stablehlo.composite"') == len(labels)  # one cluster per composite op
    if shutil.which("dot"):
        texts = [
            t.text or "" for t in ET.fromstring((folder / "graph.svg").read_text()).iter(f"{SVG_NS}text")
        ]
        assert any(t.startswith("composite tpuc.layer_norm") for t in texts), texts

    # Without the composites pass: no such clusters.
    off = tmp_path / "off"
    compiled = torch.compile(
        model,
        backend="tpu",
        options={"dump_dir": str(off), "cache_dir": None, "passes": {"composites": False}},
    )
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(x)
    (folder,) = [p for p in off.iterdir() if p.is_dir()]
    assert "composite tpuc." not in (folder / "graph.dot").read_text()
