"""Compiling for devices this machine lacks: `options={"target": "tpu:v5e:2x2"}`.

libtpu compiles for a TPU slice without a TPU (its compile-only topology). Each AOTAutograd
graph is lowered as for the TPU (no CPU host kernels), compiled for the slice, and written to
the persistent cache under the key a TPU host running the same libtpu computes, so that it
loads the executable instead of compiling. XLA's plan for each executable (memory per chip,
flops, bytes accessed) is reported before any TPU is rented. Calling a function compiled for a
target raises `TargetUnavailableError` once its executables are written; `tpuc.precompile`
runs the graphs in PyTorch instead (on the inputs' device, `meta` included) so that a whole
training step can be compiled. With `options["stand_in"]` (`StandIn`) the same target-lowered
graphs also run on this machine's plugin, so calls return results.

This is an ending of the one road (road.py): the graphs come here prepared as for every other
device (prepare.py), and dims with a declared maximum compile one executable per bucket.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from pathlib import Path

import torch

from . import _native, autograd_cache, buckets, counters, dump, fx_export, mutations, runtime, user_code
from . import sharding as sharding_mod
from .target_spec import TargetSpec


class TargetUnavailableError(_native.TpucError):
    """A function compiled for a target was called on a machine without its devices."""


class DeviceMemoryError(_native.TpucError):
    """A graph needs more memory per device than the target's devices have."""


_lock = threading.Lock()
_targets: dict[str, _native.Target] = {}


def get_target(spec: TargetSpec) -> _native.Target:
    """The process's compile-only target for `spec` (libtpu loaded once, never unloaded)."""
    with _lock:
        t = _targets.get(spec.name)
        if t is None:
            path = runtime.resolve_plugin(spec.family)
            # Without a TPU, libtpu would wait minutes for a cloud metadata server.
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
            if not runtime.hardware_present(spec.family):
                # libtpu takes a lock file that refuses a second process: right for a TPU's
                # devices, needless for compiling (none are opened), where it would serialize
                # every process that compiles for a target.
                os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
                # Else libtpu logs an error about the cloud workers it looks for at start.
                os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
            try:
                t = _native.Target(str(path), spec.plugin_topology, spec.name)
            except _native.PjrtError as e:
                raise _native.PjrtError(
                    f"tpuc: libtpu {path} cannot describe the target {spec.name}: {e}"
                ) from None
            if t.device_count != spec.chips:
                raise ValueError(
                    f"tpuc: target {spec.name} names {spec.chips} chips, libtpu's topology has {t.device_count}"
                )
            _targets[spec.name] = t
        return t


# precompile's session: while set, calls run the graphs in PyTorch, and reports collect here.
_session = threading.local()


def start_session() -> None:
    _session.reports = []


def end_session() -> list[dict]:
    reports = getattr(_session, "reports", None) or []
    _session.reports = None
    return reports


def _in_session() -> bool:
    return getattr(_session, "reports", None) is not None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _mesh_hint(need: float, devices: int, spec: TargetSpec) -> str:
    """The smallest mesh over which `need` bytes per chip (on `devices` chips) would fit if the
    memory split evenly, which fsdp approaches."""
    fits = next(
        (
            n
            for n in (2**k for k in range(1, 16))
            if n > devices and need * devices / n <= spec.hbm_bytes * 0.9
        ),
        None,
    )
    if fits is None:
        return "no slice of up to 32768 chips fits it split evenly"
    option = f"options={{'mesh': {{'shape': [{fits}], 'axes': ['fsdp']}}, 'sharding': 'fsdp'}}"
    where = "" if fits <= spec.chips else f"a slice of at least {fits} chips with "
    return f"split over {fits} chips it would need about {fmt_bytes(need * devices / fits)} each: {where}{option}"


def largest_tensors(gm: torch.fx.GraphModule, k: int = 3) -> str:
    """The `k` largest tensors the graph's ops make, with the user's line that made each:
    `; largest tensors: 18.00 GiB `mul` f32[73728, 65536] at model.py:5 (c = a * b), ...`
    ("" when none has a size): where a program does not fit, what holds its memory."""
    sized = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op != "call_function" or not isinstance(v, torch.Tensor):
            continue
        if not all(isinstance(d, int) for d in v.shape):
            continue
        sized.append((v.numel() * v.element_size(), n, v))
    sized.sort(key=lambda t: -t[0])
    parts = []
    for size, n, v in sized[:k]:
        where = user_code.describe(n)
        text = f" at {where}" if where else ""
        dtype = str(v.dtype).removeprefix("torch.")
        parts.append(f"{fmt_bytes(size)} `{n.name}` {dtype}{list(v.shape)}{text}")
    return f"; largest tensors: {', '.join(parts)}" if parts else ""


def _check_memory(report: dict, spec: TargetSpec, name: str, gm: torch.fx.GraphModule) -> None:
    """DeviceMemoryError when the graph `gm`'s footprint per chip exceeds the chip's HBM, naming
    its [`largest_tensors`] (looked for only then)."""
    need, have = report["footprint_bytes"], spec.hbm_bytes
    if need <= have:
        return
    h = report["hbm_bytes"]
    raise DeviceMemoryError(
        f"tpuc: graph {name} needs {fmt_bytes(need)} per chip on {spec.name} ({fmt_bytes(h['arguments'])} "
        f"arguments, {fmt_bytes(h['outputs'])} outputs, {fmt_bytes(h['temporaries'])} temporaries, "
        f"{fmt_bytes(h['code'])} code), more than a {spec.generation} chip's {fmt_bytes(have)} of HBM; "
        + _mesh_hint(need, report["devices"], spec)
        + largest_tensors(gm)
    )


_XLA_OOM = re.compile(r"required for [\w ]+ \((\d+(?:\.\d+)?)([KMGT])\)")


def _compile_oom(
    e: Exception, spec: TargetSpec, name: str, graph, devices: int, where: str = ""
) -> DeviceMemoryError | None:
    """XLA:TPU's own refusal of a program that cannot fit (RESOURCE_EXHAUSTED at compile time)
    as a DeviceMemoryError with the same sizes, a mesh hint and `where` ([`largest_tensors`]);
    None for other errors."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    m = _XLA_OOM.search(text)
    if m:
        need = float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    else:  # at least its inputs
        need = sum(_dense_bytes(i[1], i[2]) for i in graph.inputs() if i[0] == "tensor")
    return DeviceMemoryError(
        f"tpuc: graph {name} needs about {fmt_bytes(need)} per chip on {spec.name}, more than a "
        f"{spec.generation} chip's {fmt_bytes(spec.hbm_bytes)} of HBM; {_mesh_hint(need, devices, spec)} "
        f"(XLA: {text.strip().splitlines()[0]}){where}"
    )


def _dense_bytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n * getattr(torch, dtype, torch.float32).itemsize


class TargetGraph:
    """One AOTAutograd graph compiled for a target: once for static shapes (when it is made),
    else per bucket of its declared dynamic dims (buckets.py; per shape where the bucketing
    pass cannot make it exact, or nothing is declared). Called boxed."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, opts, spec: TargetSpec, name: str, maxima=None, shard=None):
        self.gm = gm
        self.opts = opts
        self.spec = spec
        self.name = name
        self.target = get_target(spec)
        dumping = opts.dump_dir is not None
        self.fx_text = gm.print_readable(print_output=False) if dumping else None
        _text, self.pass_report, self.graph, _attrs, _rng, _floats = fx_export.export_cleaned(
            gm, opts.enabled_passes(), texts=False
        )
        counters.record_passes(self.pass_report)
        counters.add(graphs_compiled=1)
        # The written state's new values reuse its buffers (input-output aliasing): the memory
        # per chip counts the state once, as a JAX step with donated arguments does.
        written = mutations.written_inputs(gm)
        if written:
            self.graph = self.graph.with_written_inputs(written)
        self.inputs = self.graph.inputs()
        self.sharded = None
        if shard is not None:
            ctx, kind = shard
            self.sharded = sharding_mod.ShardedGraph(ctx, kind, gm, self.inputs, self.graph.outputs(), None)
            maxima = None  # a mesh compiles each shape statically, as on the CPU
        symbolic = any(k[0] == "symint" or any(isinstance(d, str) for d in k[1]) for k in self.inputs)
        self.maxima = buckets.with_sizes(maxima, opts.buckets) if symbolic else {}
        self.reports: dict[tuple, dict] = {}
        self.lock = threading.Lock()
        # A static graph compiles now, as the CPU's does: saving and tracing then write its
        # executable without a call.
        self.static = None if symbolic else self._compile({}, self.graph)
        self.static_reported = False

    def compile_for(self, args) -> dict:
        """The target report for `args`' shapes (their bucket's), compiling on first sight."""
        if self.static is not None:
            with self.lock:  # the first call reports how the compile went, later ones "memory"
                first, self.static_reported = not self.static_reported, True
            return self.static if first else {**self.static, "cache": "memory"}
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        with self.lock:
            report = self.reports.get(shapes)
            if report is not None:
                return {**report, "cache": "memory"}
            bindings = self.graph.bindings(
                [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args],
                [int(a) if not isinstance(a, torch.Tensor) else None for a in args],
            )
            report = self._bucket_report(bindings) if self.maxima else None
            if report is None:
                report = self._compile(bindings, self.graph)
            self.reports[shapes] = report
            return report

    def _bucket_report(self, bindings: dict) -> dict | None:
        """The report of the bucket executable serving `bindings` (one per bucket, shared by
        every shape in it); None when the bucketing pass cannot make this graph exact."""
        chosen = buckets.bucket_of(self.maxima, bindings)
        key = buckets.key(chosen, bindings)
        hit = self.reports.get(key)
        if hit is not None:
            return hit
        try:
            _key, bg = buckets.bucket_graph(self.graph, chosen, bindings)
        except _native.TpucError as e:
            self.maxima = {}
            warnings.warn(
                f"tpuc: graph {self.name} is compiled for {self.spec.name} per shape instead of per bucket: {e}",
                stacklevel=6,
            )
            return None
        tagged = {**{k: v for k, v in bindings.items() if k not in chosen}}
        tagged.update({f"{k}_bucket": v for k, v in chosen.items()})
        report = self._compile({}, bg.graph, tagged)
        self.reports[key] = report
        return report

    def _compile(self, bindings: dict, graph, tag: dict | None = None) -> dict:
        cache_dir = str(self.opts.cache_dir) if self.opts.cache_dir is not None else None
        cache_max = self.opts.cache_max_bytes
        request = self.sharded.request() if self.sharded is not None else None
        t = time.perf_counter()
        try:
            report = self.target.compile(
                graph,
                bindings,
                self.opts.precision,
                cache_dir,
                cache_max,
                request,
                self.opts.dump_dir is not None,
            )
        except _native.PjrtError as e:
            devices = self.sharded.ctx.mesh.size if self.sharded is not None else 1
            oom = _compile_oom(e, self.spec, self.name, graph, devices, largest_tensors(self.gm))
            if oom is not None:
                raise oom from None
            raise
        seconds = time.perf_counter() - t
        if self.sharded is not None and report.get("sharding") is not None:
            self.sharded.record_specs(report["sharding"])
        autograd_cache.record(_Keyed(report["key"]))  # a saved file carries the entry
        miss = report["cache"] == "miss"
        counters.add(
            xla_compiles=int(miss),
            cache_hits_disk=int(not miss),
            lower_seconds=report["lower_seconds"],
            compile_seconds=seconds - report["lower_seconds"],
        )
        report = {"name": self.name, "bindings": tag if tag is not None else bindings, **report}
        if self.opts.dump_dir is not None:
            _dump(self, report)
            report.pop("mlir", None)
        _check_memory(report, self.spec, self.name, self.gm)
        return report

    def __call__(self, args: list):
        report = self.compile_for(args)
        if _in_session():
            _session.reports.append(report)
            return list(self.gm(*args))
        cache = self.opts.cache_dir
        where = f"written to the cache {cache}" if cache is not None else "not kept (no cache_dir)"
        raise TargetUnavailableError(
            f"tpuc: {self.name} was compiled for {self.spec.name} (executables {where}); this machine "
            f"has no {self.spec.family.upper()} to run it. On a host with the devices, the same tpuc and the "
            f"same libtpu ({self.target.platform_version.splitlines()[0]}), the same call with the same "
            "options (target and cache_dir included) loads them instead of compiling and runs; "
            "tpuc.precompile(..., options={'target': ...}) compiles a model without calling it; "
            "options={'stand_in': 'cpu'} runs the same graphs on this machine's CPU"
        )


class _Keyed:
    """What `autograd_cache.record` reads of an executable: its cache key."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


class StandIn:
    """A target's graph that also runs here (`options["stand_in"]`): each call compiles (or
    finds) the target's executable for its shapes or bucket, as a TargetGraph does, then runs
    the same graph lowered by the target's rules (no host kernels) on this machine's plugin
    (`here`, a CompiledGraph on road.py's stand-in runtime). In a precompile session the
    graph runs in PyTorch, as without a stand-in."""

    _boxed_call = True

    def __init__(self, target: TargetGraph, here):
        self.target = target
        self.here = here

    def __call__(self, args: list):
        report = self.target.compile_for(args)
        if _in_session():
            _session.reports.append(report)
            return list(self.target.gm(*args))
        return self.here(args)


def check_lowerable(bad: list, name: str, spec: TargetSpec) -> None:
    """UnsupportedOpError for nodes without a lowering rule: a target's graphs have no PyTorch
    pieces (the device host would have to run them between executables)."""
    if not bad:
        return
    ops = sorted({str(n.target) for n in bad})
    err = _native.UnsupportedOpError(
        f"tpuc: cannot compile graph {name} for {spec.name}: no lowering rule for {', '.join(ops)} "
        "(a target's graphs must lower entirely; on the CPU plugin such ops run in PyTorch)"
    )
    err.op, err.node = str(bad[0].target), bad[0].name
    raise err


def _dump(tg: TargetGraph, report: dict) -> None:
    """A dump folder per executable, as the CPU path writes (tpuc dump reads both)."""
    tag = "_".join(f"{k}{v}" for k, v in sorted(report["bindings"].items())) or "static"
    folder = (
        Path(tg.opts.dump_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}_{dump.next_index():04d}_{tg.name}_{tag}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fx_graph.txt").write_text(tg.fx_text or "")
    mlir = report.get("mlir", "")
    (folder / "stablehlo.mlir").write_text(mlir)
    shlo = dump.stablehlo_op_counts(mlir)
    meta = {
        "format": dump.FORMAT,
        "cache_key": report["key"],
        "cache": report["cache"],
        "graph": tg.name,
        "bindings": report["bindings"],
        "target": tg.spec.name,
        "devices": report["devices"],
        "inputs": [{"shape": s, "dtype": d} for s, d in report["inputs"]],
        "outputs": [{"shape": s, "dtype": d} for s, d in report["outputs"]],
        "options": {k: str(v) for k, v in tg.opts.__dict__.items()},
        "hbm_bytes": report["hbm_bytes"],
        "footprint_bytes": report["footprint_bytes"],
        "cost": report["cost"],
        "timings": {"lower_seconds": report["lower_seconds"], "compile_seconds": report["compile_seconds"]},
        "op_counts": tg.graph.op_counts(),
        "ops": tg.graph.op_count(),
        "stablehlo_op_counts": shlo,
        "stablehlo_ops": sum(v for k, v in shlo.items() if k not in dump.STRUCTURAL_OPS),
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def table(per_graph: list[dict]) -> list[str]:
    """`tpuc precompile --target`'s table: one row per executable."""
    head = f"{'graph':<18} {'devices':>7} {'arguments':>11} {'outputs':>11} {'aliased':>11} {'temporaries':>11} {'code':>10} {'per chip':>11} {'GFLOP':>9} {'compile s':>9} cache"
    rows = [head]
    for r in per_graph:
        h = r["hbm_bytes"]
        flops = r.get("flops")
        rows.append(
            f"{r['name']:<18} {r['devices']:>7} {fmt_bytes(h['arguments']):>11} {fmt_bytes(h['outputs']):>11} "
            f"{fmt_bytes(h['aliased']):>11} "
            f"{fmt_bytes(h['temporaries']):>11} {fmt_bytes(h['code']):>10} {fmt_bytes(r['footprint_bytes']):>11} "
            f"{(flops or 0) / 1e9:>9.2f} {r['compile_seconds']:>9.1f} {r['cache']}"
        )
    return rows
