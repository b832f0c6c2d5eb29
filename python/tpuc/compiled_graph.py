"""`CompiledGraph`: one AOTAutograd graph imported into the Rust IR once, then specialized,
lowered and compiled per concrete shape (or per bucket of declared dynamic sizes), and run
through PJRT (the call plan on the hot path, a general path for everything else)."""

from __future__ import annotations

import logging
import threading
import time
import warnings

import torch
import torch.fx

from . import (
    _native,
    autograd_cache,
    buckets,
    callprof,
    counters,
    dump,
    fx_export,
    mutations,
    precompile_session,
    residency,
    structured_trace,
)
from . import options as options_mod
from . import sharding as sharding_mod
from .call_plan import _call_plan, _residency, _rng_seed
from .dtypes import _DTYPES, _host_array

log = logging.getLogger("tpuc")


def cache_args(opts: options_mod.Options) -> tuple:
    """The (cache_dir, cache_max_bytes) arguments of Runtime.compile for these options."""
    if opts.cache_dir is None:
        return (None, None)
    return (str(opts.cache_dir), opts.cache_max_bytes)


def record_compile(exe) -> None:
    """Counts one executable obtained from Runtime.compile in tpuc.stats() (and records its key
    for AOTAutograd's cache entry, autograd_cache.py)."""
    autograd_cache.record(exe)
    if exe.cache == "miss":
        counters.add(xla_compiles=1, lower_seconds=exe.lower_seconds, compile_seconds=exe.compile_seconds)
    elif exe.cache == "disk":
        counters.add(cache_hits_disk=1, lower_seconds=exe.lower_seconds)
    else:
        counters.add(cache_hits_memory=1, lower_seconds=exe.lower_seconds)


class CompiledGraph:
    """One AOTAutograd graph compiled by tpuc. Called boxed: with a list of args."""

    _boxed_call = True

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        opts: options_mod.Options,
        name: str,
        rt: _native.Runtime,
        maxima=None,
        shard=None,
        free_layouts=None,
    ):
        """`rt`: the runtime to compile and run on (road.py resolved it once per compile);
        `free_layouts`: (output positions that may come back in their physical layout, called
        with {position: permutation} of those that did), see handoff.py."""
        self.opts = opts
        # With fallback="eager", a shape tpuc cannot lower runs this graph in PyTorch instead.
        self.eager = gm if opts.fallback == "eager" else None
        self.name = name
        shard_ctx, shard_kind = shard if shard is not None else (None, None)
        self.runtime = rt
        # The texts only dumps read: printing the FX graph alone costs more than lowering it.
        dumping = opts.dump_dir is not None
        self.fx_text = gm.print_readable(print_output=False) if dumping else None
        # Random ops take a fresh seed per call, drawn from torch's generator (the last input).
        self.imported_text, self.pass_report, self.graph, attr_targets, self.rng, symfloats = (
            fx_export.export_cleaned(gm, opts.enabled_passes(), texts=dumping)
        )
        # Size-derived floats, inputs after the attributes, computed per shape from the sizes.
        self.symfloat_exprs = [n.meta["val"].node.expr for n in symfloats]
        self.attr_tensors = [getattr(gm, t) for t in attr_targets]
        counters.record_passes(self.pass_report)
        written = mutations.written_inputs(gm)
        if written and shard_ctx is None and not rt.host_zero_copy:
            # A discrete device uploads each input for the call: the written state's upload is
            # a private copy, so its new value is computed into it (donated, runner.rs) instead
            # of into a second buffer. Not on the CPU plugin, whose inputs are the tensors'
            # memory itself (the plugin would copy them first), nor under a mesh, whose pieces
            # run through another path.
            self.graph = self.graph.with_written_inputs(written)
        self.inputs = self.graph.inputs()
        self.tensor_slots = [i for i, k in enumerate(self.inputs) if k[0] == "tensor"]
        self.symbolic = any(k[0] == "symint" or any(isinstance(d, str) for d in k[1]) for k in self.inputs)
        self.executables: dict = {}
        self.slots = [_native.Slot() for _ in self.inputs]
        self.device_arg = _residency(self.runtime, opts.residency)
        self.lock = threading.Lock()
        # Symbols with a declared maximum are bucketed: {symbol: (maximum, source, bucket sizes)}.
        self.maxima = buckets.with_sizes(maxima, opts.buckets)
        self.output_kinds = self.graph.outputs()
        # SPMD over a mesh: compiled per static shape (bucketing does not combine with it yet).
        self.sharded = None
        if shard_ctx is not None:
            self.sharded = sharding_mod.ShardedGraph(
                shard_ctx,
                shard_kind,
                gm,
                self.inputs,
                self.output_kinds,
                self.runtime,
                residency.keeps_resident(self.runtime, opts.residency),
            )
            self.maxima = {}
        self.bucketing = self.symbolic and bool(self.maxima)
        self.bucket_exes: dict = {}
        self.last_bindings: dict | None = None
        counters.add(graphs_compiled=1)
        precompile_session.record_graph(self)
        # Per-call phase timings, logged every so many calls, when TPUC_LOG asks for debug.
        self.profile = callprof.CallProfile(name) if callprof.enabled() else None
        self.fast = None  # the static executable's CallPlan: most calls need nothing else
        free = free_layouts is not None and free_layouts[0] and not self.symbolic and self.sharded is None
        if free:
            self.graph = self.graph.with_free_layout_outputs(free_layouts[0])
        if not self.symbolic:
            self.static = self._compile({}, None, fallback=self._call)
            if free:
                exe, plan = self.static[0], self.static[2]
                perms = exe.output_perms
                free_layouts[1](
                    {
                        pos: perms[int(v)]
                        for pos, (kind, v) in enumerate(plan)
                        if kind == "tensor" and perms[int(v)] is not None
                    }
                )
            self.fast = self.static[4]
        else:
            self.static = None

    def _compile(self, bindings: dict, key, fallback=None):
        request = self.sharded.request() if self.sharded is not None else None
        exe = self.runtime.compile(self.graph, bindings, self.opts.precision, *cache_args(self.opts), request)
        if self.sharded is not None:
            self.sharded.compiled(exe)
        record_compile(exe)
        structured_trace.record(self.name, exe, bindings)
        counters.record_graph_compile(self.name, exe)
        out_types = [(tuple(s), _DTYPES[d]) for s, d in exe.output_types]
        plan = exe.output_plan()
        floats = self.symfloats(bindings)
        call_plan = None
        if self.sharded is None:
            try:
                call_plan = _call_plan(self, exe, out_types, plan, floats, fallback)
            except (KeyError, ValueError) as e:  # a type the plan cannot describe: general path
                log.debug("tpuc: no call plan for %s: %s", self.name, e)
        entry = (exe, out_types, plan, floats, call_plan)
        if self.opts.dump_dir is not None:
            dump.write(self, exe, bindings)
        log.debug("tpuc: compiled %s for %s (%s)", self.name, bindings or "static shapes", exe.cache)
        return entry

    def _entry_for(self, args):
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        entry = self.executables.get(shapes)
        if entry is None:
            with self.lock:
                entry = self.executables.get(shapes)
                if entry is None:
                    bindings = self.graph.bindings(
                        [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args],
                        [int(a) if not isinstance(a, torch.Tensor) else None for a in args],
                    )
                    if self.bucketing:
                        entry = self._bucket_plan(bindings)
                        if entry is not None:
                            self.executables[shapes] = entry
                            return entry
                    try:
                        entry = self._compile(bindings, shapes)
                    except _native.TpucError as e:
                        if self.eager is None:
                            raise
                        _lowering_fallback(e, self.name)
                        entry = _EAGER
                    self.executables[shapes] = entry
        return entry

    def symfloats(self, bindings: dict) -> list:
        """The size-derived float inputs at real sizes `bindings`, as 0-d float64 tensors."""
        out = []
        for expr in self.symfloat_exprs:
            subs = {sym: bindings[str(sym)] for sym in expr.free_symbols}
            out.append(torch.tensor(float(expr.xreplace(subs)), dtype=torch.float64))
        return out

    def bucket_of(self, bindings: dict) -> dict:
        """The bucket sizes for real `bindings`; raises ValueError above a declared maximum."""
        return buckets.bucket_of(self.maxima, bindings)

    def bucket_graph(self, chosen: dict, bindings: dict):
        """(key, bucketed graph) for the bucket sizes `chosen` (see `buckets.bucket_graph`)."""
        return buckets.bucket_graph(self.graph, chosen, bindings)

    def add_bucket_executable(self, key, exe, bg) -> None:
        record_compile(exe)
        structured_trace.record(self.name, exe)
        counters.record_graph_compile(self.name, exe)
        if self.opts.dump_dir is not None:
            chosen, others = key
            dump.write(self, exe, {**dict(others), **{f"{k}_bucket": v for k, v in chosen}})
        log.debug("tpuc: compiled %s for bucket %s (%s)", self.name, key[0], exe.cache)
        self.bucket_exes[key] = (exe, bg)

    def not_bucketable(self, e: Exception) -> None:
        self.bucketing = False
        warnings.warn(
            f"tpuc: graph {self.name} is compiled per shape instead of per bucket: {e}", stacklevel=6
        )

    def bucket_executable(self, chosen: dict, bindings: dict):
        """(executable, bucketed graph) for one bucket, compiled once; None when the bucketing
        pass cannot make this graph exact (the graph is then compiled per shape)."""
        hit = self.bucket_exes.get(_bucket_key(chosen, bindings))
        if hit is not None:
            return hit
        try:
            key, bg = self.bucket_graph(chosen, bindings)
            exe = self.runtime.compile(bg.graph, {}, self.opts.precision, *cache_args(self.opts))
        except _native.TpucError as e:
            self.not_bucketable(e)
            return None
        self.add_bucket_executable(key, exe, bg)
        return exe, bg

    def _bucket_plan(self, bindings: dict):
        self.last_bindings = bindings
        chosen = self.bucket_of(bindings)
        hit = self.bucket_executable(chosen, bindings)
        if hit is None:
            return None
        exe, bg = hit
        pads = [s if s is not None and buckets.needs_padding(s) else None for s in bg.input_sizes(bindings)]
        unpads = [s if buckets.needs_padding(s) else None for s in bg.output_sizes(bindings)]
        scalars = [torch.tensor(v, dtype=torch.int64) for v in bg.scalar_values(bindings)]
        results = []
        for kind, value in self.output_kinds:
            if kind in ("tensor", "input"):
                results.append((kind, int(value)))
            elif kind == "sym":
                results.append(("value", _native.eval_sym(value, bindings)))
            elif kind == "int":
                results.append(("value", int(value)))
            else:
                results.append(("value", None))
        out_types = [(tuple(s), _DTYPES[d]) for s, d in exe.output_types]
        return buckets.Plan(exe, out_types, pads, scalars, results, unpads, self.symfloats(bindings))

    def _run_bucketed(self, plan, args):
        specs, keep = self._input_specs(args, plan.pads)
        specs.extend(plan.scalar_arrays)
        outs = [torch.empty(s, dtype=d) for s, d in plan.out_types]
        plan.exe.run(specs, [_host_array(o) for o in outs])
        counters.count_execution()
        result = []
        for kind, value in plan.results:
            if kind == "tensor":
                spec = plan.unpads[value]
                o = outs[value]
                result.append(o if spec is None else buckets.unpad(o, spec))
            elif kind == "input":
                result.append(args[value])  # the caller's tensor at its real size, never padded
            else:
                result.append(value)
        return result

    def _input_specs(self, args, pads=None) -> tuple[list, list]:
        """What `Executable.run` takes for each tensor input (a resident DeviceBuffer or a host
        array), and the temporaries that must outlive the call. `pads`: per input, the bucket
        layout to pad it to, or None."""
        specs = []
        keep = []
        for i in self.tensor_slots:
            t = args[i]
            if t.device.type != "cpu":
                t = t.cpu()
            if t.is_neg() or t.is_conj():
                t = t.resolve_conj().resolve_neg()  # lazy views: materialize their values
            pad = pads[i] if pads is not None else None
            if pad is not None:
                t = buckets.pad(t, pad)
            elif not t.is_contiguous():
                t = t.contiguous()
            buf = self.device_arg(self.slots[i], t) if t is args[i] else None
            if buf is not None:
                specs.append(buf)
            else:
                keep.append(t)
                specs.append(_host_array(t))
        return specs, keep

    def __call__(self, args: list):
        # AOTAutograd calls a static graph's plan itself (`entry_point`); here every call takes
        # the general path, which runs the entry's plan when the args fit it.
        return self._call(args)

    def entry_point(self):
        """What AOTAutograd calls: a static graph's call plan itself (falling back to this
        graph's general path), unless calls are profiled; else this graph."""
        return self.fast if self.fast is not None and self.profile is None else self

    def _run_plan_profiled(self, plan: _native.CallPlan, args: list, t_start: int):
        """The plan's call with each phase timed into `self.profile` (TPUC_LOG=debug)."""
        t0 = time.perf_counter_ns()
        out, (inputs, upload, execute, outputs) = plan.call_timed(args)
        t1 = time.perf_counter_ns()
        if out is None:
            return None
        phases = {
            "inputs": int(inputs * 1e9),
            "upload": int(upload * 1e9),
            "execute": int(execute * 1e9),
            "outputs": int(outputs * 1e9),
        }
        self.profile.add(plan=t0 - t_start, rust_call=(t1 - t0) - sum(phases.values()), **phases)
        return out

    def _call(self, args: list):
        """The general path: shape lookup, eager fallback, buckets, sharding, inputs that need
        a copy (non-contiguous, another device)."""
        profile = self.profile
        if profile is not None:
            t_start = time.perf_counter_ns()
        user_args = args
        args = list(args) + self.attr_tensors
        entry = self.static or self._entry_for(args)
        if entry is _EAGER:
            return list(self.eager(*args[: len(args) - len(self.attr_tensors)]))
        call_plan = entry[4] if type(entry) is tuple else None
        if call_plan is not None:
            if profile is not None:
                out = self._run_plan_profiled(call_plan, user_args, t_start)
            else:
                out = call_plan.try_call(user_args)
            if out is not None:
                return out
            if profile is not None:
                profile.count_general()
        seed = [_rng_seed()] if self.rng else []
        if type(entry) is buckets.Plan:
            return self._run_bucketed(entry, args + entry.symfloats + seed)
        exe, out_types, plan, floats, _ = entry
        args += floats + seed
        if self.sharded is not None:
            outs = self.sharded.run(exe, [args[i] for i in self.tensor_slots], out_types, _host_array)
        else:
            specs, keep = self._input_specs(args)
            outs = [torch.empty(s, dtype=d) for s, d in out_types]
            exe.run(specs, [_host_array(o) for o in outs])
            counters.count_execution()
            outs = [o if p is None else o.permute(p) for o, p in zip(outs, exe.output_perms, strict=True)]
        result = []
        for kind, value in plan:
            if kind == "tensor":
                result.append(outs[int(value)])
            elif kind == "input":
                result.append(args[int(value)])
            elif kind == "int":
                result.append(int(value))
            else:
                result.append(None)
        return result


_EAGER = ("eager",)


_bucket_key = buckets.key


def _lowering_fallback(e: Exception, graph_name: str) -> None:
    """Records and reports a graph that runs in PyTorch because tpuc could not lower it."""
    op = getattr(e, "op", None) or "<graph>"
    counters.count_fallback(op)
    warnings.warn(f"tpuc: running graph {graph_name} in eager PyTorch: {e}", stacklevel=4)
