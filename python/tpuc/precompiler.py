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
import time
import warnings

import torch

from . import _native, compile_workers, compiled_graph, precompile_session, structured_trace, targets
from . import buckets as bucketing
from . import options as options_mod

log = logging.getLogger("tpuc")

# `precompile(training=STEP)`: the model is a whole training step, called as it is.
STEP = "step"


def precompile(
    model, example_inputs, dynamic=None, buckets=None, options=None, progress=False, training=False
) -> dict:
    """Compiles `model` for every bucket of its dynamic dims into the persistent cache.

    `dynamic`: {input index: {dim: declared maximum}}; `buckets`: list of sizes or "pow2"
    (default: the `buckets` option); `training`: also the backward graphs (one training step:
    the forward with gradients, then the backward of the sum of its floating outputs), or
    `"step"` for a target: `model` is a whole training step (a function calling zero_grad, the
    forward, `loss.backward()` and the optimizer's `step`), called once as it is (grad mode on;
    in PyTorch, so on meta tensors nothing is computed), whose program is one executable for
    the target: its "per_graph" entry has the memory per chip of the whole step. Returns
    {"executables", "compiled", "from_cache", "seconds", "compile_seconds", "processes",
    "graphs", "buckets"}; with `options["target"]` also "target" and "per_graph" (one dict per
    executable: "name", "hbm_bytes", "flops", "compile_seconds", ... see targets.py)."""
    t0 = time.perf_counter()
    opts_dict = dict(options or {})
    if buckets is not None:
        opts_dict["buckets"] = buckets
    opts = options_mod.parse(opts_dict)
    if training not in (False, True, STEP):
        raise ValueError(f"tpuc.precompile: training must be False, True or {STEP!r}, got {training!r}")
    if training == STEP and opts.target is None:
        raise NotImplementedError(
            f"tpuc.precompile(training={STEP!r}) is for a target (options={{'target': ...}}); on this "
            "machine's plugin, call the compiled step once to fill the cache"
        )
    if opts.target is not None:
        return _precompile_for_target(model, example_inputs, dynamic, opts_dict, opts, training, t0)
    if training:
        raise NotImplementedError(
            "tpuc.precompile(training=True) is for a target (options={'target': ...}); on this "
            "machine's plugin, call the compiled training step once to fill the cache"
        )
    if opts.mesh is not None:
        raise NotImplementedError(
            "tpuc.precompile: a mesh (SPMD) compiles each shape statically and is not precompiled yet; "
            "call the compiled model once per shape to fill the cache"
        )
    dynamic = {int(i): {int(d): int(mx) for d, mx in dims.items()} for i, dims in (dynamic or {}).items()}
    inputs = list(example_inputs)
    _mark_dynamic(inputs, dynamic)
    forward = model.forward if isinstance(model, torch.nn.Module) else model
    arg_names = list(inspect.signature(forward).parameters)

    with precompile_session.recording() as graphs:
        compiled = torch.compile(model, backend="tpu", options=opts_dict)
        with torch.no_grad():
            compiled(*inputs)

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
            *compiled_graph.cache_args(opts),
            progress=progress and not outcomes,
        )
        report["compile_seconds"] += time.perf_counter() - t
        for k, exe in enumerate(exes):
            compiled_graph.record_compile(exe)
            structured_trace.record(cg.name, exe, all_bindings[k])
            report["executables"] += 1
            report["compiled" if (outcomes[k] if outcomes else exe.cache) == "miss" else "from_cache"] += 1
    report["seconds"] = time.perf_counter() - t0
    return report


def _mark_dynamic(inputs: list, dynamic: dict) -> None:
    for idx, dims in dynamic.items():
        for dim, maximum in dims.items():
            if inputs[idx].shape[dim] > maximum:
                raise ValueError(
                    f"tpuc.precompile: input {idx} dim {dim} is {inputs[idx].shape[dim]}, above its maximum {maximum}"
                )
            torch._dynamo.mark_dynamic(inputs[idx], dim, max=maximum)


def _step(compiled, inputs: list, training: bool) -> None:
    """One call of `compiled`; with `training`, the backward of its floating outputs' sum; a
    whole step (`STEP`) runs its own backward and update."""
    if training == STEP:
        with torch.enable_grad():
            compiled(*inputs)
        return
    if not training:
        with torch.no_grad():
            compiled(*inputs)
        return
    out = compiled(*inputs)
    leaves = [
        t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not leaves:
        raise ValueError("tpuc.precompile(training=True): the model's outputs need no gradient")
    sum(t.float().sum() for t in leaves).backward()


def _warn_missing_gradients(model: torch.nn.Module) -> None:
    """Warns when the training step gave parameters no gradient: the backward graph then
    computes less than a real step (on the meta device, PyTorch has no autograd kernel for some
    ops, such as nll_loss, and gradients stop there)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in params if p.grad is None]
    if missing:
        meta = any(p.device.type == "meta" for _n, p in params)
        hint = (
            " (on the meta device some losses, e.g. cross_entropy's nll_loss, have no autograd kernel: "
            "return the logits and precompile differentiates their sum)"
            if meta
            else ""
        )
        warnings.warn(
            f"tpuc.precompile(training=True): {len(missing)} of {len(params)} parameters got no gradient "
            f"(first: {missing[0]}), so the backward graph compiled is not a full training step{hint}",
            RuntimeWarning,
            stacklevel=3,
        )


def _bucket_inputs(inputs: list, dynamic: dict, opts) -> list[list]:
    """The example inputs resized to every combination of their dynamic dims' buckets (new
    tensors of the same dtype and device, zeros; the example call's own sizes first)."""
    dims = [
        (i, d, bucketing.bucket_sizes(opts.buckets, mx)) for i, ds in dynamic.items() for d, mx in ds.items()
    ]
    out = [inputs]
    for combo in itertools.product(*(sizes for _i, _d, sizes in dims)):
        shapes = {i: list(inputs[i].shape) for i, _d, _s in dims}
        for (i, d, _s), n in zip(dims, combo, strict=True):
            shapes[i][d] = n
        resized = [
            torch.zeros(shapes[k], dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
            if k in shapes
            else t
            for k, t in enumerate(inputs)
        ]
        if any(list(inputs[k].shape) != s for k, s in shapes.items()):
            out.append(resized)
    return out


def _precompile_for_target(model, example_inputs, dynamic, opts_dict, opts, training, t0) -> dict:
    """precompile for `options["target"]`: the model is traced and each graph compiled for the
    target, then run in PyTorch (on the inputs' device: `meta` works, nothing is allocated),
    once per bucket combination; what XLA planned per executable comes back in "per_graph"."""
    dynamic = {int(i): {int(d): int(mx) for d, mx in dims.items()} for i, dims in (dynamic or {}).items()}
    inputs = list(example_inputs)
    _mark_dynamic(inputs, dynamic)
    compiled = torch.compile(model, backend="tpu", options=opts_dict)
    targets.start_session()
    try:
        for args in _bucket_inputs(inputs, dynamic, opts):
            _step(compiled, args, training)
    finally:
        reports = targets.end_session()
    if training is True and isinstance(model, torch.nn.Module):
        _warn_missing_gradients(model)
    per_graph, seen = [], set()
    for r in reports:
        if r["key"] not in seen:
            seen.add(r["key"])
            per_graph.append(r)
    misses = sum(r["cache"] == "miss" for r in per_graph)
    # Per graph, the sizes of its dynamic dims each executable was compiled for (its buckets).
    buckets: dict[str, list[dict]] = {}
    for r in per_graph:
        if r.get("bindings"):
            buckets.setdefault(r["name"], []).append(dict(r["bindings"]))
    return {
        "target": opts.target,
        "per_graph": per_graph,
        "executables": len(per_graph),
        "compiled": misses,
        "from_cache": len(per_graph) - misses,
        "graphs": len({r["name"] for r in per_graph}),
        "buckets": buckets,
        "compile_seconds": sum(r["compile_seconds"] for r in per_graph if r["cache"] == "miss"),
        "processes": 1,
        "seconds": time.perf_counter() - t0,
    }


def _in_workers(jobs: list, opts, progress, report) -> list | None:
    """Compiles `jobs` ([(graph, bindings)]) into the disk cache in worker processes when that
    can run in parallel (see compile_workers); returns what each job's compile did there, or
    None when this process compiles them itself. The caller then loads them (disk hits)."""
    cache_dir, cache_max = compiled_graph.cache_args(opts)
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
    jobs = []
    try:
        for chosen in combos:
            done = cg.bucket_exes.get(compiled_graph._bucket_key(chosen, cg.last_bindings))
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
        *compiled_graph.cache_args(opts),
        progress=progress and not outcomes,
    )
    report["compile_seconds"] += time.perf_counter() - t
    for k, ((key, bg), exe) in enumerate(zip(jobs, exes, strict=True)):
        cg.add_bucket_executable(key, exe, bg)
        report["executables"] += 1
        report["compiled" if (outcomes[k] if outcomes else exe.cache) == "miss" else "from_cache"] += 1
