"""The `torch.compile` backend: `torch.compile(model, backend="tpu")`.

Dynamo hands us its graph; AOTAutograd (core ATen decompositions, decompositions.py) turns it
into functional forward/backward graphs; each graph goes through `compile_hook.compile_graph`
on the compile's one road (road.py: here, a target, its stand-in), whose usual ending is a
`CompiledGraph` (compiled_graph.py): imported into the Rust IR once, then specialized, lowered
and compiled per concrete shape, and run through PJRT. Ops without a
lowering rule run in PyTorch (`fallback="eager"`, partitions.py) or raise (`fallback="error"`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.fx
from torch._dynamo.exc import ShortenTraceback
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import aot_module_simplified
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import (
    _native,
    autograd_cache,
    buckets,
    handoff,
    input_views,
    mutations,
    prepare,
    resize,
    saved,
    untraced,
    whole_step,
)
from . import options as options_mod
from . import sharding as sharding_mod
from .compile_hook import compile_graph
from .decompositions import _decompositions, has_control_flow
from .road import Road

log = logging.getLogger("tpuc")

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


# A training step (zero_grad, forward, backward, optimizer step) traced as one graph, in frames
# traced for this backend only.
whole_step.install(tpu_backend)


def _compile(gm, example_inputs, options, mode, kwargs):
    global _graph_counter
    if kwargs:
        raise ValueError(
            f"tpuc: unexpected backend argument(s) {sorted(kwargs)}; pass settings in options={{...}}"
        )
    opts = options_mod.parse(options, mode)
    # The compile's context: options, target, plugin and runtime resolved once (a bad plugin or
    # target fails here, before tracing).
    road = Road(opts)
    opts, mesh = road.opts, road.mesh
    # Bilinear resizing's coordinates as eager rounds them (XLA would fuse their multiply-add).
    resize.static_bilinear(gm)
    with _counter_lock:
        _graph_counter += 1
        gid = _graph_counter
    t0 = time.perf_counter()
    prefix = "g" if road.spec is None else "t"

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
    # Not for a target's graphs (their entries would be the target's executables).
    caching = not saving and not maxima and road.spec is None and autograd_cache.enabled(opts, mesh)

    shard_ctx = None
    if mesh is not None:
        shard_ctx = sharding_mod.Context.for_dynamo_graph(gm, example_inputs, mesh, opts.sharding)
        maxima = {}

    direct = []  # the forward graph, when Dynamo may call it without AOTAutograd's wrapper
    grad_enabled = torch.is_grad_enabled()  # as AOTAutograd reads it (Dynamo guards it)

    # What passes from forward to backward in another layout than row-major: saved views of
    # inputs (input_views.py) and channels-last activations (handoff.py); not for sharded,
    # bucketed or saved compilations, nor a target's (its executables take row-major inputs).
    pair = (
        handoff.Handoff() if shard_ctx is None and not maxima and not saving and road.spec is None else None
    )

    def compiler(kind: str):
        def compile_one(g, ins):
            if kind == "forward":  # the inputs it writes, for input-output aliasing
                mutations.record_aot_writes(g)
            shard = (shard_ctx, kind) if shard_ctx else None
            name = f"{prefix}{gid}_{kind}"
            if caching:
                # The graph as AOTAutograd made it (FlexAttention inlined, the backward's inputs
                # in the layouts the forward hands over), for the cache entry: a process that
                # loads it compiles the same modules (see saving below).
                prepare.STEPS[0].run(road, prepare.Job(g, name, maxima, shard, None))
                free_layouts, permuted_args = layouts(g, kind)
                graph = _pickled_or_none(g, name)
                writes = mutations.written_inputs(g)  # before compile_graph renumbers them
                layout = {
                    "free_positions": free_layouts[0] if free_layouts else None,
                    "permuted_args": permuted_args,
                }
                keys: list = []
                t0 = time.perf_counter_ns()
                with autograd_cache.collecting(keys):
                    compiled = compile_laid_out(g, ins, kind, shard, name, free_layouts, permuted_args)
                code = saved.TpucOutputCode.capture(
                    compiled, graph, options, mode, name, keys, opts.cache_dir, layout, writes
                )
                code._time_taken_ns = time.perf_counter_ns() - t0  # AOTAutograd's "time saved"
                return code
            if not saving:
                return compile_laid_out(g, ins, kind, shard, name, *layouts(g, kind))
            # Before compile_graph rewrites it, but with FlexAttention already inlined: loading
            # cannot retrace it (the unpickled graph's fake tensors belong to other fake modes).
            prepare.STEPS[0].run(road, prepare.Job(g, name, maxima, shard, None))
            graph = saved.pickle_graph(g)
            writes = mutations.written_inputs(g)
            if road.spec is None:  # the executables stay in the persistent cache
                compiled = compile_graph(g, ins, road, name, traces, maxima, shard)
                return saved.TpucOutputCode.capture(compiled, graph, options, mode, name, writes=writes)
            # A target's executables travel in the file: a host with its devices loads them.
            keys: list = []
            with autograd_cache.collecting(keys):
                compiled = compile_graph(g, ins, road, name, traces, maxima, shard)
            return saved.TpucOutputCode.capture(
                compiled, graph, options, mode, name, keys, opts.cache_dir, writes=writes
            )

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
            compiled = compile_graph(g, ins, road, name, traces, maxima, shard, free_layouts)
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
    # A target's attention is always math: what XLA:TPU fuses itself (no CPU kernels).
    fused_ok = not needs_grad and not maxima and shard_ctx is None and road.spec is None
    cache_ctx = autograd_cache.caching(opts, mode, maxima) if caching else contextlib.nullcontext()
    with (
        cache_ctx,
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if fused_ok else SDPBackend.MATH),
    ):
        out = aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compiler("forward"),
            # Runs inside `loss.backward()`, maybe in a compiled step: never traced by Dynamo.
            bw_compiler=untraced.backward_compiler(compiler("backward")),
            decompositions=_decompositions(bool(maxima), has_control_flow(gm)),
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
