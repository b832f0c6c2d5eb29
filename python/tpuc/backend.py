"""The `torch.compile` backend: `torch.compile(model, backend="tpu")`.

Dynamo hands us its graph; AOTAutograd (core ATen decompositions) turns it into functional
forward/backward graphs; each graph becomes a `CompiledGraph`: imported into the Rust IR once,
then specialized, lowered and compiled per concrete shape, and run through PJRT.
Ops without a lowering rule run in PyTorch (`fallback="eager"`) or raise (`fallback="error"`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import threading
import time
import warnings
import weakref

import torch
import torch.fx
from torch._decomp import core_aten_decompositions
from torch._dynamo.exc import ShortenTraceback
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import (
    _native,
    autograd_cache,
    buckets,
    callprof,
    counters,
    dump,
    flex,
    fx_export,
    handoff,
    input_views,
    mutations,
    precompiler,
    regions,
    residency,
    runtime,
    saved,
    targets,
    ties,
    torch_kernels,
)
from . import options as options_mod
from . import sharding as sharding_mod

log = logging.getLogger("tpuc")

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "uint64": torch.uint64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

_supported_ops = frozenset(_native.supported_ops())

# Core ATen decompositions, minus one that is wrong in torch 2.15: the CPU flash-attention
# decomposition returns the attention weights where the op's second result is the logsumexp.
_DECOMPOSITIONS = {
    op: fn
    for op, fn in core_aten_decompositions().items()
    if op is not torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
}
# With bucketing, compound ops that reduce over a (possibly padded) batch or sequence dim are
# decomposed into primitive reductions, which the bucketing pass knows how to mask.
_BUCKET_DECOMPOSITIONS = {
    **_DECOMPOSITIONS,
    **torch._decomp.get_decompositions(
        [
            torch.ops.aten.native_layer_norm_backward,
            torch.ops.aten.native_batch_norm_backward,
            torch.ops.aten._native_batch_norm_legit_functional,
            torch.ops.aten._native_batch_norm_legit,
            torch.ops.aten.native_batch_norm,
            torch.ops.aten.native_group_norm_backward,
            torch.ops.aten.nll_loss_forward,
            torch.ops.aten.nll_loss_backward,
        ]
    ),
}


def _grouped_mm(
    mat1: torch.Tensor, mat2: torch.Tensor, offs: torch.Tensor | None = None, bias=None, out_dtype=None
):
    """`torch._grouped_mm` for a 2-d `mat1` (rows sorted by group) and a 3-d `mat2` (one matrix
    per group, `offs` the groups' cumulative row ends), in ops with static shapes: the product
    of every row with every group's matrix, then each row's own group selected (rows past the
    last end are zero, as in transformers' `grouped_mm_fallback`), equal to the kernel's to
    float rounding (each row is the same dot product, summed in XLA's order). The cost is one
    product per group (fine for MoE inference with few experts or few tokens). Other layouts keep
    the op (unsupported: it falls back)."""
    if (
        mat1.dim() != 2
        or mat2.dim() != 3
        or offs is None
        or bias is not None
        or out_dtype not in (None, mat1.dtype)
    ):
        return NotImplemented
    rows = torch.arange(mat1.shape[0], device=mat1.device, dtype=offs.dtype)
    group = (rows.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)  # each row's group; E past the end
    every = torch.einsum("sk,ekn->esn", mat1, mat2)
    index = group.clamp(max=mat2.shape[0] - 1).view(1, -1, 1).expand(1, mat1.shape[0], mat2.shape[2])
    picked = torch.take_along_dim(every, index, dim=0).squeeze(0)
    return torch.where((group < mat2.shape[0]).unsqueeze(1), picked, torch.zeros((), dtype=picked.dtype))


_DECOMPOSITIONS[torch.ops.aten._grouped_mm.default] = _grouped_mm
_BUCKET_DECOMPOSITIONS[torch.ops.aten._grouped_mm.default] = _grouped_mm


def _index_put_by_select(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    """A non-accumulating `index_put` along one dim (`target[..., idx, ...] = values`: a static
    cache's KV write, `index_copy_`) as selects: which target rows `idx` names, the first value
    naming each, and `where`. Used with bucketing only: the bucketing pass masks these ops
    exactly (a padded `idx` entry matches no row), while a write with padded indices would land
    on a real row. Costs len(idx) x rows comparisons; duplicate indices (whose winner PyTorch
    leaves unspecified) take the first. Other forms keep the op."""
    live = [i for i, t in enumerate(indices) if t is not None]
    if accumulate or len(live) != 1 or values.dim() != target.dim():
        return NotImplemented
    d = live[0]
    idx = indices[d]
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32) or idx.dtype == torch.bool:
        return NotImplemented
    rows = target.shape[d]
    idx = torch.where(idx < 0, idx + rows, idx)
    match = idx.unsqueeze(1) == torch.arange(rows, dtype=idx.dtype, device=idx.device)  # (len, rows)
    hit = match.any(0)
    picked = values if values.shape[d] == 1 else values.index_select(d, match.to(torch.int32).argmax(0))
    shape = [1] * target.dim()
    shape[d] = rows
    return torch.where(hit.view(shape), picked.to(target.dtype), target)


for _op in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
    _BUCKET_DECOMPOSITIONS[_op] = _index_put_by_select


def _index_put_by_mask(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    """`index_put` whose one index is a boolean mask (`x[mask] = values`, `x[:, mask] += v`), in
    ops with static shapes: each True position's rank among the True positions (a cumulative
    sum) picks its value, `where` writes it. The values' count along the mask's dim must equal
    the number of True elements, which only the data knows: a `_assert_async` checks it (tpuc
    checks it on the host after the call), so a mismatch raises instead of writing clamped or
    unused values. A mask followed by other indices keeps the op."""
    live = [i for i, t in enumerate(indices) if t is not None]
    if len(live) != 1 or indices[live[0]].dtype != torch.bool:
        return NotImplemented
    k = live[0]
    mask = indices[k]
    r = mask.dim()
    if tuple(mask.shape) != tuple(target.shape[k : k + r]):
        return NotImplemented
    rest = list(target.shape[k + r :])
    result = [*target.shape[:k], -1, *rest]  # the indexing result's shape, N = the True count
    if values.dim() > len(result):
        return NotImplemented
    vshape = [1] * (len(result) - values.dim()) + list(values.shape)
    n = vshape[k]
    flat = mask.reshape(-1)
    m = flat.shape[0]
    if n == 1:  # one value broadcast to every True position
        picked = (
            values.reshape(vshape).expand([*target.shape[:k], 1, *rest]).expand([*target.shape[:k], m, *rest])
        )
    else:
        torch._assert_async(
            flat.sum() == n,
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
            f"the indexing result (the boolean mask's number of True elements is not {n})",
        )
        if n == 0:  # no values (an all-False mask, checked above): nothing is written
            return target.clone()
        rank = (torch.cumsum(flat.to(torch.int64), 0) - 1).clamp(0, n - 1)
        full = values.reshape(vshape).expand([*target.shape[:k], n, *rest])
        picked = full.index_select(k, rank)
    picked = picked.reshape(target.shape).to(target.dtype)
    where = mask.reshape([1] * k + list(mask.shape) + [1] * len(rest))
    if accumulate:
        return target + torch.where(where, picked, torch.zeros((), dtype=target.dtype))
    return torch.where(where, picked, target)


def _index_put(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    return _index_put_by_mask(target, indices, values, accumulate)


def _bucket_index_put(target: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    out = _index_put_by_mask(target, indices, values, accumulate)
    return out if out is not NotImplemented else _index_put_by_select(target, indices, values, accumulate)


for _op in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
    _DECOMPOSITIONS[_op] = _index_put
    _BUCKET_DECOMPOSITIONS[_op] = _bucket_index_put


def _decompositions(bucketed: bool) -> dict:
    """The decomposition table, plus transformers' opaque MoE expert product
    (`transformers::grouped_mm_fallback`: a Python loop over the groups with a host sync, which
    transformers uses under torch.compile where `torch._grouped_mm` has no kernel, e.g. float32
    on CPU) once transformers has registered it: it is `torch._grouped_mm` without bias."""
    table = _BUCKET_DECOMPOSITIONS if bucketed else _DECOMPOSITIONS
    try:
        op = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):
        return table
    return {**table, op: _grouped_mm}


_warned_fallback: set[str] = set()
_warn_lock = threading.Lock()


def _host_array(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.nbytes, _DTYPE_NAMES[t.dtype], list(t.shape))


# Output allocation on the hot path: Inductor's own allocator for CPU tensors (about 0.5 us, a
# quarter of `torch.empty(shape, dtype=...)`), where this torch has it.
_empty_strided = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_empty_strided = getattr(_empty_strided, "_empty_strided_cpu", None) or (
    lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
)


def _contiguous_strides(shape: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _call_plan(graph: CompiledGraph, exe, out_types, plan, floats, fallback=None) -> _native.CallPlan:
    """The hot path of calling `exe` (see python/src/hot.rs): everything about a call that does
    not change between calls, computed once. Per tensor input its position, shape and dtype
    (checked, then passed to Rust as a resident DeviceBuffer or a bare data pointer), per output
    its type (lent to torch in place on the CPU plugin, else copied into a fresh tensor), and
    how the graph's outputs are assembled. A call that does not fit the plan (a tensor on
    another device, non-contiguous, another shape or dtype) goes to `fallback` (the graph's
    general path; `try_call` returns None instead)."""
    inputs = [
        (i, tuple(shape), _DTYPES[dtype], graph.slots[i], _DTYPES[dtype].is_complex)
        for i, (shape, dtype) in zip(graph.tensor_slots, exe.input_types, strict=True)
    ]
    outputs = [(s, _contiguous_strides(s), d) for s, d in out_types]
    result = [
        int(v)
        if kind == "tensor"
        else ("input", int(v))
        if kind == "input"
        else ("value", int(v) if kind == "int" else None)
        for kind, v in plan
    ]
    return _native.CallPlan(
        exe,
        inputs,
        outputs,
        result,
        [*graph.attr_tensors, *floats],  # inputs after the caller's (fixed per executable)
        _rng_seed if graph.rng else None,  # then a fresh seed per call
        graph.device_arg,
        _empty_strided,
        _from_dlpack,
        fallback,
    )


_from_dlpack = torch._C._from_dlpack


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


def _residency(rt, mode: str = "auto"):
    """`device_arg(slot, t)`: the resident buffer of input tensor `t` at a position whose
    `_native.Slot` is `slot`, uploading it the second time the same storage comes back (or after
    it changed), else None. Holds the runtime, not the graph (call plans keep it).

    A resident buffer is reused while `residency.still_resident`; which buffers may stay resident
    at all is `residency.keeps_resident`'s rule: a buffer that is the tensor's memory reads
    whatever wrote it; a copy misses writes PyTorch does not version."""
    enabled, copies = residency.keeps_resident(rt, mode)
    align = rt.host_align if rt.host_zero_copy and not copies else 1

    def never(slot: _native.Slot, t: torch.Tensor):
        return None

    def device_arg(slot: _native.Slot, t: torch.Tensor):
        ptr = t.data_ptr()
        storage = t.untyped_storage()
        if residency.still_resident(slot, t, ptr, storage):
            return slot.buffer
        slot.tensor = slot.buffer = slot.storage = None
        if ptr % align:
            return None  # the plugin would copy it (see above)
        if slot.ref is not None and slot.ref() is storage:
            # Seen before at this position: keep it resident from now on.
            buffer = rt.upload(_host_array(t))
            counters.count_upload()
            if not (copies or buffer.aliases_host):
                slot.ref = None
                return None  # the plugin copied it after all (see above)
            slot.tensor, slot.version, slot.ptr, slot.storage = t, t._version, ptr, storage
            slot.aliased, slot.buffer = buffer.aliases_host, buffer
            return buffer
        slot.ref = weakref.ref(storage)
        return None

    # Read by the call plan, which then skips this call for tensors that cannot be resident:
    # an address off this alignment at a position with nothing resident (0: never resident).
    never.align = 0
    device_arg.align = align
    return device_arg if enabled else never


class CompiledGraph:
    """One AOTAutograd graph compiled by tpuc. Called boxed: with a list of args."""

    _boxed_call = True

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        opts: options_mod.Options,
        name: str,
        maxima=None,
        shard=None,
        free_layouts=None,
    ):
        """`free_layouts`: (output positions that may come back in their physical layout,
        called with {position: permutation} of those that did), see handoff.py."""
        self.opts = opts
        # With fallback="eager", a shape tpuc cannot lower runs this graph in PyTorch instead.
        self.eager = gm if opts.fallback == "eager" else None
        self.name = name
        shard_ctx, shard_kind = shard if shard is not None else (None, None)
        self.runtime = runtime.get_runtime(
            opts.plugin, shard_ctx.mesh.size if shard_ctx else None, opts.plugin_options
        )
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
        self.inputs = self.graph.inputs()
        self.tensor_slots = [i for i, k in enumerate(self.inputs) if k[0] == "tensor"]
        self.symbolic = any(k[0] == "symint" or any(isinstance(d, str) for d in k[1]) for k in self.inputs)
        self.executables: dict = {}
        self.slots = [_native.Slot() for _ in self.inputs]
        self.device_arg = _residency(self.runtime, opts.residency)
        self.lock = threading.Lock()
        # Symbols with a declared maximum are bucketed: {symbol: (maximum, source, bucket sizes)}.
        self.maxima = {
            sym: (mx, src, buckets.bucket_sizes(opts.buckets, mx))
            for sym, (mx, src) in (maxima or {}).items()
        }
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
        precompiler.record_graph(self)
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
        chosen = {}
        for sym, (mx, src, sizes) in self.maxima.items():
            if sym not in bindings:
                continue
            n = bindings[sym]
            if n > mx:
                raise ValueError(
                    f"tpuc: {buckets.describe(src)} has size {n}, above its declared maximum {mx} "
                    "(torch._dynamo.mark_dynamic(..., max=...))"
                )
            chosen[sym] = buckets.choose(n, sizes)
        return chosen

    def bucket_graph(self, chosen: dict, bindings: dict):
        """(key, bucketed graph) for the bucket sizes `chosen` (other symbols at their values in
        `bindings`); raises TpucError when the pass cannot make this graph exact."""
        sizes = {**bindings, **chosen}
        bg = _native.bucket_graph(self.graph, [s for s, b in chosen.items() if b > 1], sizes)
        return _bucket_key(chosen, bindings), bg

    def add_bucket_executable(self, key, exe, bg) -> None:
        record_compile(exe)
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


def _rng_seed() -> torch.Tensor:
    """Two random int64 words from torch's default generator: `torch.manual_seed` makes compiled
    random ops repeatable, and each call draws new numbers."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)


def _bucket_key(chosen: dict, bindings: dict) -> tuple:
    """Identifies one bucket's executable: the bucket sizes and every other symbol's value."""
    others = tuple(sorted((k, v) for k, v in bindings.items() if k not in chosen))
    return tuple(sorted(chosen.items())), others


def _lowering_fallback(e: Exception, graph_name: str) -> None:
    """Records and reports a graph that runs in PyTorch because tpuc could not lower it."""
    op = getattr(e, "op", None) or "<graph>"
    counters.count_fallback(op)
    warnings.warn(f"tpuc: running graph {graph_name} in eager PyTorch: {e}", stacklevel=4)


class _PartitionModule(torch.nn.Module):
    """Stands in for a partition of supported ops inside a graph that also runs eager ops."""

    def __init__(self, compiled: CompiledGraph, single_output: bool):
        super().__init__()
        self.compiled = compiled
        self.single_output = single_output

    def forward(self, *args):
        outs = self.compiled(list(args))
        return outs[0] if self.single_output else tuple(outs)


def _is_tensor_op(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    return n.op == "call_function" and not isinstance(val, torch.SymInt | int | torch.SymFloat | float)


def _representable(val) -> bool:
    """Whether tpuc can type a value: supported dtypes, and no data-dependent (unbacked) sizes."""
    if isinstance(val, list | tuple):
        return all(_representable(v) for v in val)
    if isinstance(val, torch.Tensor):
        return val.dtype in _DTYPE_NAMES and not free_unbacked_symbols(val)
    return True


_STORAGE_OPS = frozenset({"aten.as_strided.default", "aten.as_strided_scatter.default"})

# Ops whose lowering rules are checked on complex tensors (tests/test_linalg_complex.py); any other
# op touching a complex tensor runs in PyTorch (or raises with fallback="error"), since rules
# written for real dtypes may not know complex semantics (abs, division, sign ...).
_COMPLEX_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "_conj.default _conj_physical.default conj_physical.default view_as_real.default "
        "view_as_complex.default complex.default polar.default real.default imag.default "
        "_fft_r2c.default _fft_c2c.default _fft_c2r.default _to_copy.default clone.default "
        "alias.default view.default _unsafe_view.default permute.default expand.default "
        "slice.Tensor select.int squeeze.dim squeeze.dims unsqueeze.default cat.default "
        "constant_pad_nd.default flip.default tril.default triu.default where.self "
        "add.Tensor sub.Tensor mul.Tensor neg.default exp.default log.default log1p.default "
        "sqrt.default rsqrt.default sin.default tanh.default reciprocal.default "
        "pow.Tensor_Scalar sum.dim_IntList sum.default mean.dim mean.default prod.dim_int cumsum.default "
        "mm.default bmm.default eq.Tensor ne.Tensor isnan.default sigmoid.default "
        "scalar_tensor.default full_like.default "
        # Data movement, whose rules never look at the element type (Lumina2's complex rotary
        # frequencies are repeated, gathered and copied, QwenImage's split;
        # tests/test_sweep_diffusers.py).
        "repeat.default gather.default full.default copy.default split_with_sizes.default "
        "split.Tensor index.Tensor index_select.default"
    ).split()
)


def _owns_dense_storage(arg) -> bool:
    """Whether `arg`'s storage is exactly its elements in row-major order. tpuc values are dense
    row-major arrays, so ops that address the storage (as_strided) are only exact then."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    return (
        val.is_contiguous()
        and val.storage_offset() == 0
        and val.untyped_storage().nbytes() == val.numel() * val.element_size()
    )


def _static_layout(val) -> bool:
    """Whether a tensor's sizes, strides and storage offset are plain ints: asking a symbolic
    one about its layout would add guards that specialize dynamic dims."""
    if not isinstance(val, torch.Tensor):
        return False
    try:
        dims = (*val.shape, *val.stride(), val.storage_offset())
    except Exception:  # no strides (sparse, nested)
        return False
    return all(type(d) is int for d in dims)


def _storage_key(val: torch.Tensor):
    try:
        return val.untyped_storage()._cdata
    except Exception:  # a tensor without storage (sparse, nested): never matched
        return None


def _rebase_storage_ops(gm: torch.fx.GraphModule) -> int:
    """Points each `as_strided` whose operand is a view that is not its own dense storage (a
    strided slice, a view with an offset, a permuted view ...) at the graph node that owns that
    storage densely (the node the view was taken from, through any chain of views), with the
    view's storage offset made explicit. as_strided addresses the storage, not the view, so the
    result is the same, and the owner is a dense row-major array as tpuc holds every value: the
    op lowers exactly (a reshape or a gather) instead of running in PyTorch on a dense copy of the
    view, whose storage is not the one eager PyTorch addressed (Longformer's chunked attention).
    Returns the number of ops rewritten."""
    owners: dict = {}
    permuted: dict = {}  # storage -> (node, dim order) of values that fill it in a permuted order
    changed = 0
    for n in list(gm.graph.nodes):
        val = n.meta.get("val")
        if not _static_layout(val):
            continue  # symbolic layouts are left alone (and as_strided over them falls back)
        if str(n.target) == "aten.as_strided.default" and isinstance(n.args[0], torch.fx.Node):
            x = n.args[0]
            xval = x.meta.get("val")
            if not _static_layout(xval):
                continue
            key = _storage_key(xval) if isinstance(xval, torch.Tensor) else None
            base = owners.get(key)
            if base is None and key in permuted and not _owns_dense_storage(x):
                # The storage is a permuted dense tensor's (a clone of a transposed view keeps
                # its strides): its permutation into storage order is a dense row-major array.
                owner, order = permuted[key]
                with gm.graph.inserting_before(n):
                    base = gm.graph.call_function(torch.ops.aten.permute.default, (owner, order))
                base.meta["val"] = owner.meta["val"].permute(order)
                owners[key] = base
            if base is not None and base is not x and not _owns_dense_storage(x):
                size, stride = n.args[1], n.args[2]
                offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
                if offset is None:
                    offset = xval.storage_offset()
                if base.meta["val"].dtype == xval.dtype and isinstance(offset, int):
                    n.args = (base, size, stride, offset)
                    n.kwargs = {}
                    changed += 1
        key = _storage_key(val)
        if key is None:
            continue
        if _owns_dense_storage(n):
            owners.setdefault(key, n)
        elif (order := input_views.dense_order(val)) is not None:
            permuted.setdefault(key, (n, order))
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _supported(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if not _is_tensor_op(n):
        return False
    if not _representable(n.meta.get("val")):
        return False
    target = str(n.target)
    if target in _STORAGE_OPS and not _owns_dense_storage(n.args[0]):
        return False
    if ties.pytorch_order(n):
        return False
    leaves: list = []
    torch.fx.node.map_aggregate((n.args, n.kwargs), leaves.append)
    vals = [n.meta.get("val"), *(a.meta.get("val") for a in leaves if isinstance(a, torch.fx.Node))]
    tensors = [
        t for v in vals for t in (v if isinstance(v, list | tuple) else [v]) if isinstance(t, torch.Tensor)
    ]
    if target != "aten.hash_tensor.default" and any(t.dtype == torch.uint64 for t in tensors):
        return False  # uint64 is only lowered as hash_tensor's result
    if (
        target not in _COMPLEX_OPS
        and n.target is not operator.getitem
        and any(t.is_complex() for t in tensors)
    ):
        return False
    if any(isinstance(a, complex) for a in leaves):
        return False  # complex Python scalars have no wire format (complex tensors do)
    return target in _supported_ops or n.target.__name__ == "getitem"


def _why_unsupported(n: torch.fx.Node) -> str:
    """The reason `_supported` gives for `n`, for error messages."""
    target = str(n.target)
    if ties.pytorch_order(n):
        return (
            "its indices are in an order only PyTorch's own kernel gives (topk sorted=False, "
            "unstable sort of more than 16 elements, or a dim of symbolic size)"
        )
    if target in _supported_ops:
        leaves: list = []
        torch.fx.node.map_aggregate((n.args, n.kwargs), leaves.append)
        if any(isinstance(a, complex) for a in leaves):
            return "tpuc cannot pass complex Python scalars yet"
        return "tpuc does not lower it for these operands (complex or uint64 tensors, data-dependent sizes)"
    return "tpuc has no lowering rule for it"


def _unsupported_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if _is_tensor_op(n) and not _supported(n)]


def _origin(n: torch.fx.Node, traces: dict) -> str:
    """Where the user's code produced `n`: the last frame of the stack trace Dynamo recorded for
    the node it came from (AOTAutograd nodes point back to it through `from_node`)."""
    trace = n.meta.get("stack_trace")
    source = (n.meta.get("from_node") or [None])[-1]
    while not trace and source is not None:
        trace = traces.get(source.name)
        source = (source.from_node or [None])[-1]
    trace = (trace or "").strip().splitlines()
    lines = [line.strip() for line in trace if line.strip() and set(line.strip()) - set("^~ ")]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f", from {lines[last]}" + (f": {code}" if code else "")


def _warn_fallback(ops: list[str]) -> None:
    with _warn_lock:
        new = sorted(set(ops) - _warned_fallback)
        _warned_fallback.update(new)
    if new:
        warnings.warn(
            f"tpuc: running {len(new)} op(s) without a lowering rule in eager PyTorch: {', '.join(new)}",
            stacklevel=3,
        )


def _partitioned(gm: torch.fx.GraphModule, opts, name: str, maxima=None, shard=None, in_torch=frozenset()):
    """Splits `gm` into tpuc partitions (supported ops) and eager ops (unsupported ones, and
    the nodes of `in_torch`)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupport

    class Support(OperatorSupport):
        def is_node_supported(self, submodules, node):
            return node not in in_torch and _supported(node)

    partitioner = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    for node in list(fused.graph.nodes):
        if node.op != "call_module":
            continue
        sub = getattr(fused, node.target)
        out_arg = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        single = not isinstance(out_arg, list | tuple)
        if single:
            # CompiledGraph always returns a list; give the subgraph a tuple output.
            out_node = next(n for n in sub.graph.nodes if n.op == "output")
            out_node.args = ((out_arg,),)
            sub.recompile()
        part_shard = (shard[0], "partition") if shard is not None else None
        compiled = _compile_or_fallback(sub, opts, f"{name}.{node.target}", maxima, part_shard)
        if compiled is not None:
            setattr(fused, node.target, _PartitionModule(compiled, single))
        elif single:
            out_node.args = (out_arg,)  # stays eager: restore its original output
            sub.recompile()
    fused.recompile()
    return fused


def _compile_or_fallback(
    gm: torch.fx.GraphModule, opts, name: str, maxima=None, shard=None, free_layouts=None
) -> CompiledGraph | _native.CallPlan | None:
    """A CompiledGraph's entry point, or None (run `gm` eagerly) when lowering fails and
    fallback="eager".
    Plugin errors always raise: they are not a matter of op coverage."""
    try:
        return CompiledGraph(gm, opts, name, maxima, shard, free_layouts).entry_point()
    except _native.TpucError as e:
        if opts.fallback == "error" or isinstance(e, _native.PjrtError):
            raise
        _lowering_fallback(e, name)
        return None


def _hoist_checks(gm: torch.fx.GraphModule) -> list[tuple]:
    """Takes the graph's runtime checks out of `gm`, to run on the host after each call, so
    errors are raised exactly as PyTorch raises them:
    - the effectful `_linalg_check_errors` calls (`with_effects` nodes: linalg.inv, solve,
      cholesky ... raising on singular or non-positive-definite input): each one's `info`
      tensor becomes an extra graph output and its token passes through unchanged;
    - `_assert_async` (`torch._assert_async(cond, msg)`, which diffusers' models call on
      data-dependent conditions; XLA has no way to raise): its condition becomes an extra
      graph output.
    Returns one (check function, args after the tensor, kwargs) per extra output, in output
    order, for `_Checked`."""
    check = torch.ops.aten._linalg_check_errors.default
    asserts = (torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg)
    checks, tensors = [], []
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in asserts and not n.users:
            checks.append((torch._assert_async, tuple(n.args[1:]), dict(n.kwargs)))
            tensors.append(n.args[0])
            gm.graph.erase_node(n)
            continue
        if not (n.target is torch.ops.higher_order.with_effects and len(n.args) >= 3 and n.args[1] is check):
            continue
        token, info, rest = n.args[0], n.args[2], n.args[3:]
        for user in list(n.users):
            if user.op == "call_function" and user.target.__name__ == "getitem" and user.args[1] == 0:
                user.replace_all_uses_with(token)
                gm.graph.erase_node(user)
        if n.users:
            raise _native.TpucError(f"unexpected use of the result of `{n.name}` ({check})")
        gm.graph.erase_node(n)
        checks.append((torch._linalg_check_errors, tuple(rest), dict(n.kwargs)))
        tensors.append(info)
    if not checks:
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0]
    out.args = ((*outs, *tensors),) if isinstance(outs, list | tuple) else ((outs, *tensors),)
    gm.graph.lint()
    gm.recompile()
    return checks


class _Checked:
    """Runs a compiled graph whose checks (`_linalg_check_errors`, `_assert_async`) were
    hoisted out, then the checks on the returned tensors (raising PyTorch's own errors)."""

    _boxed_call = True

    def __init__(self, inner, checks: list[tuple]):
        self.inner, self.checks = inner, checks

    def __call__(self, args):
        # Effect tokens arrive as None (AOTAutograd's runtime wrapper drops the real ones); the
        # graph only passes them through.
        if any(a is None for a in args):
            token = torch.empty(0)
            args = [token if a is None else a for a in args]
        outs = list(self.inner(args))
        k = len(self.checks)
        for t, (fn, rest, kwargs) in zip(outs[len(outs) - k :], self.checks, strict=True):
            fn(t, *rest, **kwargs)
        return outs[: len(outs) - k]


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs,
    opts,
    name: str,
    traces: dict | None = None,
    maxima=None,
    shard=None,
    free_layouts=None,
):
    """AOTAutograd's compiler hook: a boxed callable that runs `gm` through tpuc. `traces` maps
    Dynamo node names to their stack traces, for error messages; `shard`: (sharding Context,
    "forward" | "backward") when a mesh is set; `free_layouts`: see CompiledGraph."""
    flex.inline_flex_attention(gm, _decompositions(bool(maxima)))
    # Writes into inputs AOTAutograd left in the graph become outputs, written back after the call.
    writes = mutations.split(gm, rows_allowed=not maxima and shard is None)
    # Outputs that are views of inputs are made from the inputs at call time (not on a mesh,
    # whose plan places every output); an output that is an input is the caller's tensor (IR).
    taken = input_views.split(gm) if shard is None else {}
    if taken and free_layouts is not None:
        positions, back = input_views.remap_positions(taken, free_layouts[0])
        report = free_layouts[1]
        free_layouts = (positions, lambda perms: report({back[p]: perm for p, perm in perms.items()}))
    checks = _hoist_checks(gm)
    _rebase_storage_ops(gm)
    n_ties = 0
    tie_nodes = ties.checked_nodes(gm)
    if tie_nodes:
        as_is = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # what PyTorch runs, for ties
        n_ties = ties.add_tie_checks(gm, tie_nodes)
    inner = _compile_hook(gm, opts, name, traces, maxima, shard, free_layouts)
    if n_ties:
        inner = ties.TieChecked(inner, n_ties, as_is.forward, name)
    inner = _Checked(inner, checks) if checks else inner
    inner = input_views.WithInputViews(inner, taken) if taken else inner
    return mutations.WithWrites(inner, writes) if writes is not None else inner


def _compile_hook(
    gm: torch.fx.GraphModule, opts, name: str, traces: dict | None, maxima, shard, free_layouts=None
):
    traces = traces or {}
    part_shard = (shard[0], "partition") if shard is not None else None
    if regions.inlined(opts, runtime.plugin_family(runtime.resolve_plugin(opts.plugin), opts.plugin)):
        regions.inline_regions(gm)
    in_regions = regions.compile_regions(
        gm,
        lambda sub, ins, sub_name: compile_graph(
            sub, ins, opts, f"{name}.{sub_name}", traces, maxima, part_shard
        ),
    )
    bad = [n for n in _unsupported_nodes(gm) if n not in in_regions]
    in_torch = _torch_kernel_nodes(gm, opts, shard)
    if not bad and not in_torch and not in_regions:
        compiled = _compile_or_fallback(gm, opts, name, maxima, shard, free_layouts)
        return compiled if compiled is not None else make_boxed_func(gm.forward)
    for n in in_torch:
        counters.count_torch_kernel(str(n.target))
    in_torch = [*in_torch, *in_regions]
    if not bad:
        return make_boxed_func(_partitioned(gm, opts, name, maxima, shard, set(in_torch)).forward)
    if opts.fallback == "error":
        n = bad[0]
        details = "\n".join(f"  - `{b.target}` (node `{b.name}`){_origin(b, traces)}" for b in bad)
        err = _native.UnsupportedOpError(
            f"unsupported op `{n.target}` (node `{n.name}`): {_why_unsupported(n)}; "
            f"{len(bad)} unsupported node(s) in this graph:\n{details}\n"
            "use options={'fallback': 'eager'} to run them in PyTorch"
        )
        err.op, err.node = str(n.target), n.name
        raise err
    ops = [str(n.target) for n in bad]
    for op in ops:
        counters.count_fallback(op)
    _warn_fallback(ops)
    fused = _partitioned(gm, opts, name, maxima, shard, set(in_torch))
    return make_boxed_func(fused.forward)


def _torch_kernel_nodes(gm: torch.fx.GraphModule, opts, shard) -> list[torch.fx.Node]:
    """The nodes to run through PyTorch's own kernel (see torch_kernels.py): only on the CPU
    plugin and unsharded (a partitioned graph would leave the mesh)."""
    candidates = torch_kernels.nodes(gm) if shard is None else []
    if not candidates or not runtime.get_runtime(opts.plugin, None, opts.plugin_options).host_zero_copy:
        return []
    return candidates


_SURFACED: dict[type, type] = {}


def _surface(e: Exception) -> Exception:
    """The same error, made to pass through Dynamo unwrapped.

    Dynamo wraps any backend exception in BackendCompilerFailed, except ShortenTraceback; a
    subclass of both keeps the user-facing type (`except ValueError`, `except
    tpuc.UnsupportedOpError` work) and the message."""
    cls = type(e)
    sub = _SURFACED.get(cls)
    if sub is None:
        sub = type(
            cls.__name__,
            (cls, ShortenTraceback),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _SURFACED[cls] = sub
    err = sub.__new__(sub, *e.args)
    BaseException.__init__(err, *e.args)
    err.__dict__.update(getattr(e, "__dict__", {}))
    err.first_useful_frame = None
    return err


_graph_counter = 0
_counter_lock = threading.Lock()


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, options=None, mode=None, **kwargs):
    """Entry point of `torch.compile(model, backend="tpu")` (and `"tpuc"`)."""
    try:
        return _compile(gm, example_inputs, options, mode, kwargs)
    except (ValueError, NotImplementedError, PermissionError, _native.TpucError) as e:
        raise _surface(e) from e


def _compile(gm, example_inputs, options, mode, kwargs):
    global _graph_counter
    if kwargs:
        raise ValueError(
            f"tpuc: unexpected backend argument(s) {sorted(kwargs)}; pass settings in options={{...}}"
        )
    opts = options_mod.parse(options, mode)
    if opts.target is not None:
        with _counter_lock:
            _graph_counter += 1
            gid = _graph_counter
        return targets.compile_for_target(
            gm, example_inputs, opts, gid, _decompositions(False), _unsupported_nodes, CompiledGraph
        )
    mesh = sharding_mod.parse_mesh(opts)
    runtime.get_runtime(
        opts.plugin, mesh.size if mesh else None, opts.plugin_options
    )  # a bad plugin fails here
    with _counter_lock:
        _graph_counter += 1
        gid = _graph_counter
    t0 = time.perf_counter()

    traces = {n.name: n.meta.get("stack_trace") for n in gm.graph.nodes}
    # torch's AOT precompile (tpuc.save_compiled) turns AOTAutograd's bundled cache on for this
    # call: the graphs compiled below must then be OutputCode that the cache entry can store.
    saving = bool(torch._functorch.config.bundled_autograd_cache)
    if saving and mesh is not None:
        raise NotImplementedError("tpuc: saving a compiled function with a mesh (SPMD) is not supported yet")
    declared = buckets.user_declared(gm)
    maxima = buckets.declared_maxima(example_inputs, declared)
    buckets.check_declared(gm, example_inputs, declared)
    # Otherwise the graphs go into AOTAutograd's cache (autograd_cache.py), where PyTorch allows
    # (not yet for bucketed graphs, whose declared maxima the loader would not know).
    caching = not saving and not maxima and autograd_cache.enabled(opts, mesh)

    shard_ctx = None
    if mesh is not None:
        shard_ctx = sharding_mod.Context.for_dynamo_graph(gm, example_inputs, mesh, opts.sharding)
        maxima = {}

    direct = []  # the forward graph, when Dynamo may call it without AOTAutograd's wrapper
    grad_enabled = torch.is_grad_enabled()  # as AOTAutograd reads it (Dynamo guards it)

    # What passes from forward to backward in another layout than row-major: saved views of
    # inputs (input_views.py) and channels-last activations (handoff.py); not for sharded,
    # bucketed or saved compilations.
    pair = handoff.Handoff() if shard_ctx is None and not maxima and not saving else None

    def compiler(kind: str):
        def compile_one(g, ins):
            shard = (shard_ctx, kind) if shard_ctx else None
            name = f"g{gid}_{kind}"
            if caching:
                # The graph as AOTAutograd made it (FlexAttention inlined, the backward's inputs
                # in the layouts the forward hands over), for the cache entry: a process that
                # loads it compiles the same modules (see saving below).
                flex.inline_flex_attention(g, _decompositions(bool(maxima)))
                free_layouts, permuted_args = layouts(g, kind)
                graph = _pickled_or_none(g, name)
                layout = {
                    "free_positions": free_layouts[0] if free_layouts else None,
                    "permuted_args": permuted_args,
                }
                keys: list = []
                t0 = time.perf_counter_ns()
                with autograd_cache.collecting(keys):
                    compiled = compile_laid_out(g, ins, kind, shard, name, free_layouts, permuted_args)
                code = saved.TpucOutputCode.capture(
                    compiled, graph, options, mode, name, keys, opts.cache_dir, layout
                )
                code._time_taken_ns = time.perf_counter_ns() - t0  # AOTAutograd's "time saved"
                return code
            if not saving:
                return compile_laid_out(g, ins, kind, shard, name, *layouts(g, kind))
            # Before compile_graph rewrites it, but with FlexAttention already inlined: loading
            # cannot retrace it (the unpickled graph's fake tensors belong to other fake modes).
            flex.inline_flex_attention(g, _decompositions(bool(maxima)))
            graph = saved.pickle_graph(g)
            compiled = compile_graph(g, ins, opts, name, traces, maxima, shard)
            return saved.TpucOutputCode.capture(compiled, graph, options, mode, name)

        def layouts(g, kind):
            """(free_layouts for compile_graph, {input position: order} for PermutedArgs): what
            the forward may hand over in another layout, and how the backward takes it (this
            rewrites the backward graph)."""
            free_layouts, permuted_args = None, {}
            if pair is not None and kind == "forward":
                pair.views = input_views.view_outputs(g)
                positions = pair.saved_positions(g) if handoff.enabled() else []
                if positions:
                    outs = input_views.graph_outputs(g)
                    names = {i: outs[i].name for i in positions}
                    free_layouts = (positions, lambda perms: pair.forward_compiled(names, perms))
            elif pair is not None:
                # Saved views of inputs (returned as views, see input_views.py) are taken in
                # their storage order, the channels-last activations as NHWC (handoff.py).
                permuted_args = input_views.storage_order_inputs(g, pair.views) | pair.rewrite_backward(g)
            return free_layouts, permuted_args

        def compile_laid_out(g, ins, kind, shard, name, free_layouts, permuted_args):
            compiled = compile_graph(g, ins, opts, name, traces, maxima, shard, free_layouts)
            if kind == "forward" and shard is None and _plain_inference(gm, grad_enabled):
                direct.append(compiled)
            return input_views.PermutedArgs(compiled, permuted_args) if permuted_args else compiled

        if saving or caching:
            return SerializableAOTDispatchCompiler(saved.TpucOutputCode, compile_one)
        return compile_one

    # Attention where gradients flow is traced through the math path: otherwise the forward
    # decomposes to math while the backward keeps the CPU flash kernel, whose saved-tensor
    # contract the decomposed forward does not meet (gradients come out wrong, even with
    # aot_eager). Inference keeps the fused kernel where PyTorch picks it: tpuc lowers it in query
    # blocks that stay in cache, where math's matmul-softmax-matmul writes every score to memory
    # (UNet self-attention at 64x64 latents: 8 heads x 4096^2 scores, 1.8x slower). Bucketed and
    # sharded graphs keep math, which their passes know.
    needs_grad = grad_enabled and any(getattr(t, "requires_grad", False) for t in example_inputs)
    fused_ok = not needs_grad and not maxima and shard_ctx is None
    cache_ctx = autograd_cache.caching(opts, mode, maxima) if caching else contextlib.nullcontext()
    with (
        cache_ctx,
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if fused_ok else SDPBackend.MATH),
    ):
        out = aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            decompositions=_decompositions(bool(maxima)),
            # Writes into inputs stay in an inference graph (mutations.py).
            keep_inference_input_mutations=not needs_grad and shard_ctx is None,
        )
    log.debug("tpuc: graph %d traced and compiled in %.3fs", gid, time.perf_counter() - t0)
    if len(direct) == 1:
        compiled = direct[0]
        return compiled.unboxed() if isinstance(compiled, _native.CallPlan) else _Direct(compiled)
    return out


def _pickled_or_none(g: torch.fx.GraphModule, name: str) -> bytes | None:
    """`saved.pickle_graph(g)`, or None (and the graph stays out of AOTAutograd's cache) when
    it cannot be pickled."""
    try:
        return saved.pickle_graph(g)
    except Exception as e:  # pickling fails on objects it does not know: not an error of the compile
        log.debug("tpuc: graph %s stays out of AOTAutograd's cache: %s", name, e)
        return None


def _plain_inference(gm: torch.fx.GraphModule, grad_enabled: bool) -> bool:
    """Whether the graph AOTAutograd is compiling (its metadata in the tracing context) is an
    inference graph whose runtime wrapper would only call it: no autograd (grad mode off, or no
    input that requires grad: AOTAutograd's own test; Dynamo guards both), no input mutations,
    no outputs aliasing inputs or each other, no effect tokens, no functionalized RNG, no tensor
    subclasses, no autocast to turn off, and no parameters of the Dynamo graph module to prepend
    (Dynamo lifts them to inputs). Then the wrapper costs a few microseconds per call and does
    nothing."""
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta

    ctx = torch._guards.TracingContext.try_get()
    m = getattr(ctx, "fw_metadata", None)
    if m is None:
        return False
    try:
        return (
            not (grad_enabled and any(i.requires_grad for i in m.input_info))
            and not m.traced_tangents
            and not any(o.requires_grad for o in m.output_info)
            and m.num_mutated_inp_runtime_indices == 0
            and m.num_outputs_aliased == 0
            and m.num_intermediate_bases == 0
            and m.num_unsafe_view_outputs == 0
            and not m.tokens
            and not m.is_rng_op_functionalized
            and all(type(s) is PlainTensorMeta or isinstance(s, int) for s in m.subclass_inp_meta)
            and all(type(s) is PlainTensorMeta for s in m.subclass_fw_graph_out_meta)
            and not torch._C._is_any_autocast_enabled()
            and next(gm.parameters(), None) is None
            and next(gm.buffers(), None) is None
        )
    except AttributeError:  # another torch's metadata: keep AOTAutograd's wrapper
        return False


class _Direct:
    """What Dynamo calls for a plain inference graph (see `_plain_inference`): the compiled
    forward itself, boxed, without AOTAutograd's runtime wrapper (a static graph's call plan
    does the same in Rust: `CallPlan.unboxed()`)."""

    __slots__ = ("compiled",)

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        return self.compiled(list(args))
