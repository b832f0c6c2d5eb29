"""Debugging dumps (`dump_dir`): one folder per compiled graph and static shape."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

_seq = itertools.count()
_lock = threading.Lock()


def write(compiled, exe, bindings: dict) -> Path:
    """Writes what tpuc saw and produced for one executable; returns the folder."""
    with _lock:
        n = next(_seq)
    shape_tag = "_".join(f"{k}{v}" for k, v in sorted(bindings.items())) or "static"
    folder = (
        Path(compiled.opts.dump_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}_{n:04d}_{compiled.name}_{shape_tag}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fx_graph.txt").write_text(compiled.fx_text)
    (folder / "ir_0_imported.txt").write_text(compiled.imported_text)
    for i, (name, _before, _after, text) in enumerate(compiled.pass_report, start=1):
        (folder / f"ir_{i}_after_{name}.txt").write_text(text)
    (folder / "ir_specialized.txt").write_text(exe.graph_text)
    (folder / "stablehlo.mlir").write_text(exe.mlir)
    hlo = exe.optimized_hlo()
    if hlo is not None:
        (folder / "optimized_hlo.txt").write_text(hlo)
    meta = {
        "cache_key": exe.key,
        "cache": exe.cache,
        "graph": compiled.name,
        "bindings": bindings,
        "inputs": [{"shape": s, "dtype": d} for s, d in exe.input_types],
        "outputs": [{"shape": s, "dtype": d} for s, d in exe.output_types],
        "options": {k: str(v) for k, v in compiled.opts.__dict__.items()},
        "timings": {"lower_seconds": exe.lower_seconds, "compile_seconds": exe.compile_seconds},
        "passes": [{"pass": name, "ops_before": b, "ops_after": a} for name, b, a, _ in compiled.pass_report],
        "op_counts": compiled.graph.op_counts(),
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return folder
