"""Debugging dumps (`dump_dir`): one folder per compiled graph and static shape.

Each folder holds `fx_graph.txt`, `ir_*.txt` (the IR imported, after each pass, specialized),
`stablehlo.mlir`, `optimized_hlo.txt` (when the plugin gives the optimized program), `graph.dot`
and `graph.svg` (rendered by Graphviz `dot` when installed) and `meta.json`. `tpuc dump DIR`
(`tpuc.cli`) reads them back: `summarize` and `diff` below.
"""

from __future__ import annotations

import collections
import difflib
import itertools
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

_seq = itertools.count()
_lock = threading.Lock()

#: meta.json's `format`; `tpuc dump` recognizes a dump folder by it.
FORMAT = "tpuc-dump/1"

#: Graphs with more nodes than this get `graph.dot` only (a note in meta.json says why): the
#: 3000-op chain measured at SVG_CLUSTER_MAX_NODES took 4-8 s to draw, larger ones longer.
SVG_MAX_NODES = 3000
#: Above this many nodes the picture is drawn without region clusters and with cheaper placement
#: and crossing reduction (BIG_GRAPH_DOT_FLAGS). Measured on a synthetic 3000-op chain on the
#: shared 2-core machine: 21 s with clusters, 14 s without, 4-8 s with the flags too.
SVG_CLUSTER_MAX_NODES = 1500
BIG_GRAPH_DOT_FLAGS = ["-Gnslimit=1", "-Gnslimit1=1", "-Gmclimit=0.01", "-Gremincross=false"]
#: Seconds `dot` may take before the SVG is skipped: above the 4-8 s of that 3000-op chain,
#: short enough that a dump never stalls a compile for minutes.
SVG_TIMEOUT = 20.0

# One op per line in the generic MLIR form tpuc prints: `%3 = "stablehlo.add"(...)`, also
# `%0:2 = ...` and ops without results (`"stablehlo.return"(...)`).
_MLIR_OP = re.compile(r'^\s*(?:%[\w#:]+(?:\s*,\s*%[\w#:]+)*\s*=\s*)?"([A-Za-z_][\w$]*\.[\w.$]+)"', re.M)


#: Ops that only structure a module (not counted as StableHLO ops in summaries).
STRUCTURAL_OPS = ("builtin.module", "func.func", "func.return", "stablehlo.return")


def stablehlo_op_counts(mlir: str) -> dict[str, int]:
    """Ops of a module in generic form, by name (`stablehlo.add`: 3), module and func included."""
    return dict(sorted(collections.Counter(_MLIR_OP.findall(mlir)).items()))


# Locations as MLIR prints them with debug info: `#loc3 = loc(...)` aliases after the module, and
# `loc(...)` at the end of each op's line; a file and line is `"file.py":12:0`.
_LOC_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_LOC_REF = re.compile(r"#loc\d*")
_FILE_LINE = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):(\d+)')


def op_locations(mlir: str) -> list[tuple[str, str | None, int | None]]:
    """(op name, source file, line) of each op of a module printed with locations (what dumps
    write, `stablehlo.mlir`), structural ops left out; file and line are those of the innermost
    user frame (the first file:line in the op's location), None where the op has none."""
    aliases = {m.group(1): m.group(2) for m in _LOC_ALIAS.finditer(mlir)}

    def expand(text: str, depth: int = 0) -> str:
        if depth > 64 or "#loc" not in text:
            return text
        return _LOC_REF.sub(lambda m: expand(aliases.get(m.group(0), "unknown"), depth + 1), text)

    def located(line: str) -> tuple[str | None, int | None]:
        at = line.rfind(" loc(")
        fl = _FILE_LINE.search(expand(line[at + 5 : -1])) if at >= 0 and line.endswith(")") else None
        return (fl.group(1), int(fl.group(2))) if fl else (None, None)

    out: list[tuple[str, str | None, int | None]] = []
    # An op with regions (reduce, while, func) ends on its `})` line, which has its location.
    opened: list[int | None] = []
    for line in mlir.splitlines():
        stripped = line.strip()
        if stripped.startswith("})"):
            k = opened.pop() if opened else None
            if k is not None:
                out[k] = (out[k][0], *located(stripped))
            continue
        m = _MLIR_OP.match(line)
        counted = m is not None and m.group(1) not in STRUCTURAL_OPS
        if stripped.endswith("({"):
            opened.append(len(out) if counted else None)
        if counted:
            out.append((m.group(1), *located(stripped)))
    return out


_IR_OP = re.compile(r"^%\S+: [^=]* = ([A-Za-z_][\w.]*)\(", re.M)


def ir_op_counts(ir_text: str) -> dict[str, int]:
    """Ops of an IR listing (`%x: f32[2] = aten.relu.default(%y)`) by name, inputs left out."""
    return dict(sorted(collections.Counter(op for op in _IR_OP.findall(ir_text) if op != "input").items()))


def _render_svg(folder: Path, dot_text: str, n_nodes: int, exe, title: str) -> dict:
    """Writes graph.dot and, when Graphviz is installed and the graph small enough, graph.svg."""
    big = n_nodes > SVG_CLUSTER_MAX_NODES
    if big:
        dot_text, _ = exe.graph_dot(title, clusters=False)
    (folder / "graph.dot").write_text(dot_text)
    info: dict = {"dot": "graph.dot", "svg": None, "nodes": n_nodes, "clusters": not big}
    dot_bin = shutil.which("dot")
    if dot_bin is None:
        info["note"] = (
            "graph.svg not written: Graphviz `dot` is not installed (apt-get install graphviz); "
            "render graph.dot with `dot -Tsvg graph.dot -o graph.svg`"
        )
        return info
    if n_nodes > SVG_MAX_NODES:
        info["note"] = (
            f"graph.svg not written: {n_nodes} nodes is above the limit of {SVG_MAX_NODES} "
            "(tpuc.dump.SVG_MAX_NODES); render graph.dot yourself"
        )
        return info
    cmd = [dot_bin, "-Tsvg"]
    if big:
        cmd += BIG_GRAPH_DOT_FLAGS
        info["note"] = f"regions not drawn as clusters: {n_nodes} nodes (> {SVG_CLUSTER_MAX_NODES})"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, input=dot_text, capture_output=True, text=True, timeout=SVG_TIMEOUT)
    except subprocess.TimeoutExpired:
        info["note"] = (
            f"graph.svg not written: dot took longer than {SVG_TIMEOUT:g} s (tpuc.dump.SVG_TIMEOUT); "
            "render graph.dot yourself"
        )
        return info
    info["render_seconds"] = round(time.perf_counter() - t0, 4)
    if proc.returncode != 0:
        info["note"] = f"graph.svg not written: dot failed: {proc.stderr.strip()[:500]}"
        return info
    (folder / "graph.svg").write_text(proc.stdout)
    info["svg"] = "graph.svg"
    return info


def next_index() -> int:
    """The next graph folder's index in this process (folders sort in compile order)."""
    with _lock:
        return next(_seq)


def write(compiled, exe, bindings: dict) -> Path:
    """Writes what tpuc saw and produced for one executable; returns the folder."""
    t_start = time.perf_counter()
    n = next_index()
    shape_tag = "_".join(f"{k}{v}" for k, v in sorted(bindings.items())) or "static"
    folder = (
        Path(compiled.opts.dump_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}_{n:04d}_{compiled.name}_{shape_tag}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fx_graph.txt").write_text(compiled.fx_text)
    (folder / "ir_0_imported.txt").write_text(compiled.imported_text)
    for i, (name, _before, _after, text, *_rest) in enumerate(compiled.pass_report, start=1):
        (folder / f"ir_{i}_after_{name}.txt").write_text(text)
    (folder / "ir_specialized.txt").write_text(exe.graph_text)
    mlir = exe.mlir_with_locations
    (folder / "stablehlo.mlir").write_text(mlir)
    hlo = exe.optimized_hlo()
    if hlo is not None:
        (folder / "optimized_hlo.txt").write_text(hlo)
    title = f"{compiled.name} {bindings or 'static'}"
    dot_text, n_nodes = exe.graph_dot(title)
    picture = _render_svg(folder, dot_text, n_nodes, exe, title)
    shlo = stablehlo_op_counts(mlir)
    cache = exe.cache
    meta = {
        "format": FORMAT,
        "cache_key": exe.key,
        # miss: PJRT compiled it; memory / disk: found in the in-memory / persistent cache
        "cache": cache,
        "graph": compiled.name,
        "folder_index": n,
        "bindings": bindings,
        "inputs": [{"shape": s, "dtype": d} for s, d in exe.input_types],
        "outputs": [{"shape": s, "dtype": d} for s, d in exe.output_types],
        "options": {k: str(v) for k, v in compiled.opts.__dict__.items()},
        # CPU plugin: XLA's loop fusions compiled unpartitioned (run on the calling thread)
        "unpartitioned": exe.unpartitioned,
        "timings": {
            # specialize + lower to StableHLO
            "lower_seconds": exe.lower_seconds,
            # cache lookup plus the XLA compile (miss) or the executable load (disk)
            "compile_seconds": exe.compile_seconds,
            "xla_compile_seconds": exe.compile_seconds if cache == "miss" else None,
        },
        # per pass, in pipeline order: op totals before/after, the pass's own count of nodes it
        # rewrote or removed, its time, and the op counts by name after it
        "passes": [
            {
                "pass": name,
                "ops_before": b,
                "ops_after": a,
                "changes": changes,
                "seconds": round(seconds, 6),
                "op_counts_after": ir_op_counts(text),
            }
            for name, b, a, text, seconds, changes in compiled.pass_report
        ],
        "imported_op_counts": ir_op_counts(compiled.imported_text),
        "op_counts": compiled.graph.op_counts(),
        "ops": compiled.graph.op_count(),
        "stablehlo_op_counts": shlo,
        "stablehlo_ops": sum(v for k, v in shlo.items() if k not in STRUCTURAL_OPS),
        # ops whose location names a source file and line (the user's, from FX's stack traces)
        "stablehlo_ops_located": sum(1 for _, f, _ in op_locations(mlir) if f is not None),
        "optimized_hlo": "optimized_hlo.txt" if hlo is not None else None,
        "graph_picture": picture,
    }
    meta["timings"]["dump_seconds"] = round(time.perf_counter() - t_start, 4)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return folder


# ---------------------------------------------------------------- reading dumps back (tpuc dump)


class NotADump(ValueError):
    """A folder that holds no tpuc dump."""


def _is_graph_folder(p: Path) -> bool:
    return (p / "meta.json").is_file() and (p / "stablehlo.mlir").is_file()


def load(path) -> list[tuple[Path, dict]]:
    """The graph folders of a dump, in compile order, with their meta.json. `path` is a dump
    folder (`dump_dir`) or one graph folder inside it. Raises NotADump."""
    p = Path(path)
    if not p.exists():
        raise NotADump(f"{p}: no such folder")
    if not p.is_dir():
        raise NotADump(f"{p}: not a folder")
    folders = (
        [p] if _is_graph_folder(p) else sorted(c for c in p.iterdir() if c.is_dir() and _is_graph_folder(c))
    )
    out = []
    for f in folders:
        try:
            meta = json.loads((f / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise NotADump(f"{f / 'meta.json'}: unreadable ({e})") from e
        if not isinstance(meta, dict) or "cache_key" not in meta or "graph" not in meta:
            raise NotADump(f"{f / 'meta.json'}: not a tpuc dump meta.json (no cache_key/graph)")
        if "stablehlo_op_counts" not in meta:  # dumps written before these counts existed
            meta["stablehlo_op_counts"] = stablehlo_op_counts((f / "stablehlo.mlir").read_text())
        out.append((f, meta))
    if not out:
        raise NotADump(
            f"{p}: not a tpuc dump (no graph folders with meta.json and stablehlo.mlir; "
            "dumps are written with options={'dump_dir': ...} or TPUC_DUMP_DIR)"
        )
    return out


def _hlo_counts(meta: dict) -> dict[str, int]:
    return {
        k.removeprefix("stablehlo."): v
        for k, v in meta["stablehlo_op_counts"].items()
        if k not in STRUCTURAL_OPS
    }


def _shapes(items: list[dict]) -> str:
    short = {
        "float32": "f32",
        "float64": "f64",
        "float16": "f16",
        "bfloat16": "bf16",
        "int64": "i64",
        "int32": "i32",
        "complex64": "c64",
        "complex128": "c128",
    }
    return " ".join(
        f"{short.get(i['dtype'], i['dtype'])}[{','.join(str(d) for d in i['shape'])}]" for i in items
    )


def _shapes_short(items: list[dict], k: int = 4) -> str:
    """The first `k` shapes, then how many more."""
    more = f" +{len(items) - k} more" if len(items) > k else ""
    return _shapes(items[:k]) + more


def _shape_changes(side: str, a: list[dict], b: list[dict]) -> list[str]:
    """`  inputs: 5 -> 5; input 2: f32[3,8] -> f32[5,8]` (only the slots that differ)."""
    if _shapes(a) == _shapes(b):
        return []
    out = [f"  {side}: {len(a)} -> {len(b)}"]
    for i in range(max(len(a), len(b))):
        x = _shapes(a[i : i + 1]) or "none"
        y = _shapes(b[i : i + 1]) or "none"
        if x != y:
            out.append(f"    {side[:-1]} {i}: {x} -> {y}")
    return out


def _bindings(meta: dict) -> str:
    b = meta.get("bindings") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(b.items())) or "static"


def _secs(x) -> str:
    return "-" if x is None else f"{x:.3f}s"


def summarize(path, top: int = 5) -> list[str]:
    """One line per graph folder: name, bindings, StableHLO op count, top op kinds, times, cache."""
    lines = []
    graphs = load(path)
    total_ops = 0
    for folder, m in graphs:
        counts = _hlo_counts(m)
        n_ops = sum(counts.values())
        total_ops += n_ops
        tops = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top])
        t = m.get("timings", {})
        picture = m.get("graph_picture") or {}
        svg = "svg" if picture.get("svg") else "no svg"
        lines.append(
            f"{folder.name}: graph {m['graph']} [{_bindings(m)}] in {_shapes_short(m.get('inputs', []))} -> "
            f"{_shapes_short(m.get('outputs', []))} | {n_ops} stablehlo ops ({tops}) | aten ops {m.get('ops', '-')} | "
            f"lower {_secs(t.get('lower_seconds'))} compile {_secs(t.get('compile_seconds'))} | "
            f"cache {m.get('cache', '?')} {m['cache_key'][:16]} | {svg}"
            + (
                f" | {m['target']}: {m['footprint_bytes'] / 2**20:.1f} MiB per chip"
                if m.get("target") and m.get("footprint_bytes") is not None
                else ""
            )
        )
    lines.append(f"{len(graphs)} graph folder(s), {total_ops} stablehlo ops in {path}")
    return lines


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\b([a-z][\w-]*)\(")
_HLO_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)" source_line=(\d+)')


def hlo_lines(hlo: str) -> list[tuple[str, str, str, int]]:
    """(instruction, opcode, source file, line) of each instruction of XLA's optimized HLO text
    whose metadata names a source line (`optimized_hlo.txt`)."""
    out = []
    for line in hlo.splitlines():
        src = _HLO_SOURCE.search(line)
        m = _HLO_INSTRUCTION.match(line) if src else None
        if m:
            out.append((m.group(1), m.group(2), src.group(1), int(src.group(2))))
    return out


def by_line(path, top: int = 5) -> list[str]:
    """`tpuc dump --lines`: per user source line (file:line, then the line itself where the file
    is readable), what each graph made of it: StableHLO ops by kind, and the instructions of
    XLA's optimized HLO that name it (fusions by name). Ops without a location are counted at
    the end."""
    import linecache

    per_line: dict[tuple[str, int], dict[str, tuple[collections.Counter, list]]] = {}
    unlocated = 0
    graphs = load(path)
    for folder, meta in graphs:
        graph = f"{meta['graph']} [{_bindings(meta)}]"
        for op, file, line in op_locations((folder / "stablehlo.mlir").read_text()):
            if file is None:
                unlocated += 1
                continue
            entry = per_line.setdefault((file, line), {}).setdefault(graph, (collections.Counter(), []))
            entry[0][op.removeprefix("stablehlo.")] += 1
        hlo = folder / "optimized_hlo.txt"
        if hlo.is_file():
            for name, opcode, file, line in hlo_lines(hlo.read_text()):
                entry = per_line.setdefault((file, line), {}).setdefault(graph, (collections.Counter(), []))
                entry[1].append(name if opcode == "fusion" else opcode)
    out = []
    for (file, line), graphs_of in sorted(per_line.items()):
        text = linecache.getline(file, line).strip()
        out.append(f"{file}:{line}" + (f"  {text}" if text else ""))
        for graph, (ops, hlo_names) in graphs_of.items():
            kinds = ", ".join(
                f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
            )
            fusions = sorted({n for n in hlo_names if "fusion" in n})
            out.append(
                f"  {graph}: {sum(ops.values())} stablehlo ops ({kinds or '-'}) | "
                f"{len(hlo_names)} hlo instructions"
                + (f" ({', '.join(fusions[:top])}{', ...' if len(fusions) > top else ''})" if fusions else "")
            )
    out.append(
        f"{len(per_line)} source line(s) in {len(graphs)} graph folder(s); {unlocated} stablehlo op(s) without a line"
    )
    return out


def _key(folder: Path, meta: dict) -> str:
    """How graphs of two dumps are matched: graph name and bindings (folder names carry times)."""
    return f"{meta['graph']}[{_bindings(meta)}]"


def _role(meta: dict) -> str:
    """`g3_forward` -> `forward[bindings]`."""
    return f"{re.sub(r'^g[0-9]+_', '', meta['graph'])}[{_bindings(meta)}]"


def _keyed(graphs: list[tuple[Path, dict]]) -> dict[str, tuple[Path, dict]]:
    """Graphs by `_key`, in order; a key seen again (a recompile) gets `#2`, `#3`, ..."""
    out: dict[str, tuple[Path, dict]] = {}
    seen: collections.Counter = collections.Counter()
    for f, m in graphs:
        k = _key(f, m)
        seen[k] += 1
        out[k if seen[k] == 1 else f"{k}#{seen[k]}"] = (f, m)
    return out


def diff(a, b, max_mlir_lines: int = 400) -> tuple[list[str], bool]:
    """Compares two dumps (or two graph folders): returns the report lines and whether they differ."""
    ga, gb = load(a), load(b)
    single = len(ga) == 1 and len(gb) == 1 and (_is_graph_folder(Path(a)) or _is_graph_folder(Path(b)))
    if single:
        pairs = [(_key(*ga[0]), ga[0], gb[0])]
        only_a, only_b = [], []
    else:
        ma, mb = _keyed(ga), _keyed(gb)
        pairs = [(k, ma[k], mb[k]) for k in ma if k in mb]
        only_a = [k for k in ma if k not in mb]
        only_b = [k for k in mb if k not in ma]
        # Graph ids count up per process (g1_forward, g2_forward, ...): what is left is paired in
        # compile order by role (`forward`, `backward`) and bindings.
        for ka in list(only_a):
            kb = next((k for k in only_b if _role(mb[k][1]) == _role(ma[ka][1])), None)
            if kb is not None:
                pairs.append((f"{ka} ~ {kb}", ma[ka], mb[kb]))
                only_a.remove(ka)
                only_b.remove(kb)
    lines = [f"--- {a}", f"+++ {b}"]
    any_diff = bool(only_a or only_b)
    for k in only_a:
        lines.append(f"only in A: {k} ({ma[k][0].name})")
    for k in only_b:
        lines.append(f"only in B: {k} ({mb[k][0].name})")
    n_same = 0
    for k, (fa, ma_), (fb, mb_) in pairs:
        out = []
        mlir_a = (fa / "stablehlo.mlir").read_text()
        mlir_b = (fb / "stablehlo.mlir").read_text()
        if ma_["cache_key"] != mb_["cache_key"]:
            out.append(f"  cache key: {ma_['cache_key'][:16]} -> {mb_['cache_key'][:16]}")
        if _bindings(ma_) != _bindings(mb_):
            out.append(f"  bindings: {_bindings(ma_)} -> {_bindings(mb_)}")
        for side in ("inputs", "outputs"):
            out.extend(_shape_changes(side, ma_.get(side, []), mb_.get(side, [])))
        ca, cb = _hlo_counts(ma_), _hlo_counts(mb_)
        changes = [
            (op, ca.get(op, 0), cb.get(op, 0))
            for op in sorted(set(ca) | set(cb))
            if ca.get(op, 0) != cb.get(op, 0)
        ]
        if changes:
            out.append(f"  stablehlo ops: {sum(ca.values())} -> {sum(cb.values())}")
            out.extend(f"    {op}: {x} -> {y} ({y - x:+d})" for op, x, y in changes)
        aa, ab = ma_.get("op_counts", {}), mb_.get("op_counts", {})
        aten = [
            (op, aa.get(op, 0), ab.get(op, 0))
            for op in sorted(set(aa) | set(ab))
            if aa.get(op, 0) != ab.get(op, 0)
        ]
        if aten:
            out.append(f"  aten ops: {sum(aa.values())} -> {sum(ab.values())}")
            out.extend(f"    {op}: {x} -> {y} ({y - x:+d})" for op, x, y in aten)
        differs = bool(out) or mlir_a != mlir_b
        ta, tb = ma_.get("timings", {}), mb_.get("timings", {})
        times = []
        for t in ("lower_seconds", "compile_seconds"):
            x, y = ta.get(t), tb.get(t)
            if x is not None and y is not None:
                times.append(f"{t.removesuffix('_seconds')} {x:.3f}s -> {y:.3f}s ({y - x:+.3f}s)")
        if ma_.get("cache") != mb_.get("cache"):
            times.append(f"cache {ma_.get('cache')} -> {mb_.get('cache')}")
        if mlir_a != mlir_b:
            ud = list(
                difflib.unified_diff(
                    mlir_a.splitlines(),
                    mlir_b.splitlines(),
                    f"{fa.name}/stablehlo.mlir",
                    f"{fb.name}/stablehlo.mlir",
                    lineterm="",
                    n=2,
                )
            )
            if len(ud) <= max_mlir_lines:
                out.append("  stablehlo.mlir diff:")
                out.extend("    " + line for line in ud)
            else:
                out.append(f"  stablehlo.mlir differs ({len(ud)} diff lines, not shown; diff the files)")
        if differs:
            any_diff = True
            lines.append(f"{k}: DIFFERENT ({fa.name} vs {fb.name})")
            lines.extend(out)
            lines.append("  timings: " + "; ".join(times))
        else:
            n_same += 1
            lines.append(f"{k}: same module ({'; '.join(times)})")
    lines.append(
        f"{len(pairs)} graph(s) compared: {len(pairs) - n_same} different, {n_same} same; "
        f"{len(only_a)} only in A, {len(only_b)} only in B"
    )
    return lines, any_diff
