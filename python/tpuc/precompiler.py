"""Ahead-of-time compilation of shape buckets (`tpuc.precompile`, `tpuc precompile`).

The model is traced once with the declared dynamic dims (Dynamo + AOTAutograd, through the normal
backend); every symbolic graph that comes out is then specialized to each bucket and compiled in
parallel in Rust (rayon), into the persistent cache. A later process that compiles the same model
with the same options and marks finds those executables on disk.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re
import threading
import time

import torch

from . import buckets as bucketing
from . import options as options_mod

log = logging.getLogger("tpuc")
_session = threading.local()
_SOURCE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")


def record_graph(compiled_graph) -> None:
    """Called by the backend for each graph it compiles: inside `precompile`, remembers the graph
    and which (argument, dim) each of its size symbols stands for."""
    graphs = getattr(_session, "graphs", None)
    if graphs is None:
        return
    symbols = {}
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None and ctx.fake_mode.shape_env is not None:
        for sym, sources in ctx.fake_mode.shape_env.var_to_sources.items():
            for src in sources:
                m = _SOURCE.match(src.name)
                if m:
                    symbols[str(sym)] = (m.group(1), int(m.group(2)))
                    break
    graphs.append((compiled_graph, symbols))


def precompile(model, example_inputs, dynamic=None, buckets=None, options=None, progress=False) -> dict:
    """Compiles `model` for every bucket of its dynamic dims into the persistent cache.

    `dynamic`: {input index: {dim: declared maximum}}; `buckets`: list of sizes or "pow2"
    (default: the `buckets` option). Returns {"executables", "compiled", "from_cache", "seconds", "compile_seconds", "processes",
    "graphs", "buckets"}."""
    from . import backend  # imports this module: import it lazily

    t0 = time.perf_counter()
    opts_dict = dict(options or {})
    if buckets is not None:
        opts_dict["buckets"] = buckets
    opts = options_mod.parse(opts_dict)
    if opts.mesh is not None:
        raise NotImplementedError(
            "tpuc.precompile: a mesh (SPMD) compiles each shape statically and is not precompiled yet; "
            "call the compiled model once per shape to fill the cache"
        )
    dynamic = {int(i): {int(d): int(mx) for d, mx in dims.items()} for i, dims in (dynamic or {}).items()}
    inputs = list(example_inputs)
    for idx, dims in dynamic.items():
        for dim, maximum in dims.items():
            if inputs[idx].shape[dim] > maximum:
                raise ValueError(
                    f"tpuc.precompile: input {idx} dim {dim} is {inputs[idx].shape[dim]}, above its maximum {maximum}"
                )
            torch._dynamo.mark_dynamic(inputs[idx], dim, max=maximum)
    forward = model.forward if isinstance(model, torch.nn.Module) else model
    arg_names = list(inspect.signature(forward).parameters)

    _session.graphs = []
    try:
        compiled = torch.compile(model, backend="tpu", options=opts_dict)
        with torch.no_grad():
            compiled(*inputs)
        graphs = _session.graphs
    finally:
        _session.graphs = None

    report = {
        "executables": 0,
        "compiled": 0,
        "from_cache": 0,
        "graphs": len(graphs),
        "buckets": {},
        "compile_seconds": 0.0,  # compiling (or loading) the buckets, after tracing
        "processes": 1,  # compile processes used (compile_workers)
    }
    for cg, symbols in graphs:
        if not cg.symbolic:
            continue
        per_symbol = {}
        for sym, (name, dim) in symbols.items():
            idx = arg_names.index(name) if name in arg_names else None
            if idx in dynamic and dim in dynamic[idx]:
                per_symbol[sym] = bucketing.bucket_sizes(opts.buckets, dynamic[idx][dim])
        if not per_symbol:
            continue
        # Every combination of the dims' buckets: a later call of any size within them compiles
        # nothing.
        combos = [dict(zip(per_symbol, c, strict=True)) for c in itertools.product(*per_symbol.values())]
        report["buckets"][cg.name] = combos
        if cg.bucketing and cg.last_bindings is not None:
            _precompile_buckets(cg, combos, opts, progress, report)
            if cg.bucketing:
                continue
        # Not bucketable (or no declared maximum): one static executable per bucket size.
        all_bindings = [{**(cg.last_bindings or {}), **c} for c in combos]
        t = time.perf_counter()
        outcomes = _in_workers([(cg.graph, b) for b in all_bindings], opts, progress, report)
        exes = cg.runtime.compile_many(
            cg.graph,
            all_bindings,
            opts.precision,
            *backend.cache_args(opts),
            progress=progress and not outcomes,
        )
        report["compile_seconds"] += time.perf_counter() - t
        for k, exe in enumerate(exes):
            backend.record_compile(exe)
            report["executables"] += 1
            report["compiled" if (outcomes[k] if outcomes else exe.cache) == "miss" else "from_cache"] += 1
    report["seconds"] = time.perf_counter() - t0
    return report


def _in_workers(jobs: list, opts, progress, report) -> list | None:
    """Compiles `jobs` ([(graph, bindings)]) into the disk cache in worker processes when that
    can run in parallel (see compile_workers); returns what each job's compile did there, or
    None when this process compiles them itself. The caller then loads them (disk hits)."""
    from . import _native, backend, compile_workers

    cache_dir, cache_max = backend.cache_args(opts)
    n = compile_workers.process_count(len(jobs), cache_dir)
    report["processes"] = max(report.get("processes", 1), n)
    if n < 2:
        return None
    try:
        return compile_workers.compile_in_workers(
            jobs, opts.plugin, opts.precision, cache_dir, cache_max, n, progress=progress
        )
    except (OSError, _native.TpucError) as e:
        # This process compiles whatever the workers did not (and raises a real compile error
        # with its full context).
        log.warning("tpuc: compile workers failed (%s); compiling in this process", e)
        report["processes"] = 1
        return None


def _precompile_buckets(cg, combos, opts, progress, report) -> None:
    """Compiles the bucketed graph of every combination in parallel and registers the
    executables with the graph; on a graph the pass cannot make exact, turns bucketing off."""
    from . import _native, backend

    jobs = []
    try:
        for chosen in combos:
            done = cg.bucket_exes.get(backend._bucket_key(chosen, cg.last_bindings))
            if done is not None:  # the example call's own bucket
                report["executables"] += 1
                report["compiled" if done[0].cache == "miss" else "from_cache"] += 1
                continue
            jobs.append(cg.bucket_graph(chosen, cg.last_bindings))
    except _native.TpucError as e:
        cg.not_bucketable(e)
        return
    t = time.perf_counter()
    outcomes = _in_workers([(bg.graph, {}) for _, bg in jobs], opts, progress, report)
    exes = cg.runtime.compile_graphs(
        [bg.graph for _, bg in jobs],
        opts.precision,
        *backend.cache_args(opts),
        progress=progress and not outcomes,
    )
    report["compile_seconds"] += time.perf_counter() - t
    for k, ((key, bg), exe) in enumerate(zip(jobs, exes, strict=True)):
        cg.add_bucket_executable(key, exe, bg)
        report["executables"] += 1
        report["compiled" if (outcomes[k] if outcomes else exe.cache) == "miss" else "from_cache"] += 1
