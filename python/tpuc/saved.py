"""Compiled functions saved to a file and loaded in another process without tracing again.

A deployment that starts a process per worker pays Dynamo's bytecode trace and AOTAutograd's
trace (seconds for a transformer) on every start, even when tpuc's executable cache holds every
binary. PyTorch's AOT precompile (`torch.compile(...).aot_compile(...)`,
`torch.compiler.load_compiled_function`) writes Dynamo's result (bytecode and guards) and
AOTAutograd's (runtime wrappers and graphs) to a file, provided the graphs the backend compiled
are `OutputCode` that can be pickled. While such an AOT compile runs, tpuc's backend hands
AOTAutograd a `TpucOutputCode` per graph: the graph itself with tpuc's options. Loading runs
tpuc on each graph again (import, passes, lowering), and the executables come from the
persistent cache, so a new process traces nothing and compiles nothing.

    fn = tpuc.save_compiled(model, "model.tpuc", (x,))   # compiles; fn(x) runs it
    fn = tpuc.load_compiled("model.tpuc", model)         # in another process
    fn(x)
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import pickle
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.output_code import OutputCode

from . import autograd_cache, compile_hook, counters, handoff, input_views, mutations
from . import options as options_mod
from .road import Road

FORMAT = 1  # bump when the saved state changes


@dataclasses.dataclass
class TpucOutputCode(OutputCode):
    """One AOTAutograd graph (forward or backward) compiled by tpuc, in the form AOTAutograd's
    bundled cache entry stores: the graph travels pickled with tpuc's options, the executables
    stay in tpuc's cache. Loading (`post_compile`) runs tpuc on the graph again, which finds the
    executables on disk: neither Dynamo nor AOTAutograd trace anything."""

    state: bytes = b""  # pickled {"format", "graph", "options", "mode", "name"}
    compiled: Callable | None = None  # the runnable graph (boxed calling convention)
    _boxed_call: bool = True
    # tpuc's disk cache entries of the graph's executables, {key: file bytes}, which travel with
    # AOTAutograd's cache entry (autograd_cache.py); filled when it is serialized, from the keys
    # recorded while the graph compiled and the cache folder it compiled with.
    executables: dict = dataclasses.field(default_factory=dict)
    exe_keys: list = dataclasses.field(default_factory=list)
    cache_dir: str | None = None

    @classmethod
    def capture(
        cls,
        compiled,
        graph: bytes | None,
        options,
        mode,
        name: str,
        exe_keys=(),
        cache_dir=None,
        layout=None,
        writes=(),
    ) -> TpucOutputCode:
        """`graph`: `pickle_graph` of the graph `compiled` was made from (None: it could not be
        pickled, and this graph is not cached); `layout`: {"free_positions", "permuted_args"},
        the layouts it hands over or takes (backend.py) when it was compiled with them;
        `writes`: its written inputs' (input, output) pairs (`mutations.written_inputs`), which
        the pickled graph does not carry and its executables alias."""
        state = {"format": FORMAT, "graph": graph, "options": options, "mode": mode, "name": name}
        if layout:
            state["layout"] = layout
        if writes:
            state["written_inputs"] = [tuple(p) for p in writes]
        return cls(
            state=pickle.dumps(state) if graph is not None else b"",
            compiled=compiled,
            exe_keys=list(exe_keys),
            cache_dir=None if cache_dir is None else str(cache_dir),
        )

    def __call__(self, inputs):
        return self.compiled(inputs)

    def prepare_for_serialization(self) -> None:
        if not self.state:
            from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

            raise BypassAOTAutogradCache("tpuc could not pickle this graph")
        self.compiled = None  # the runnable graph is rebuilt on load
        if not self.executables:
            self.executables = autograd_cache.read_entries(self.exe_keys, self.cache_dir)
        self.exe_keys, self.cache_dir = [], None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.compiled is not None:
            return
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(self.state)
        if state.get("format") != FORMAT:
            raise ValueError(
                f"tpuc: the saved compiled function has format {state.get('format')}, this tpuc reads "
                f"{FORMAT}; save it again"
            )
        gm = GraphPickler.loads(state["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        gm.recompile()
        if state.get("written_inputs"):  # the same module as the first compile: the same aliases
            gm.meta[mutations.WRITTEN_INPUTS] = list(state["written_inputs"])
        live = autograd_cache.live_options()  # a torch.compile that hit AOTAutograd's cache
        if live is not None:
            opts = live
        else:
            opts = options_mod.parse(
                {**(state["options"] or {}), **(_LOAD_OPTIONS.get() or {})}, state["mode"]
            )
        autograd_cache.install_entries(self.executables, opts.cache_dir)
        self.executables = {}
        layout = state.get("layout") or {}
        positions, orders = layout.get("free_positions"), layout.get("permuted_args")
        # The same module as the first compile: it returns the same layouts the backward takes.
        free = (positions, _count_channels_last) if positions else None
        road = Road(opts)
        compiled = compile_hook.compile_graph(gm, example_inputs, road, state["name"], free_layouts=free)
        self.compiled = input_views.PermutedArgs(compiled, orders) if orders else compiled

    def set_triton_bundle(self, triton_bundle) -> None:
        pass  # no Triton kernels


def _count_channels_last(perms: dict) -> None:
    counters.add(saved_channels_last=sum(tuple(p) == handoff.NCHW_OF_NHWC for p in perms.values()))


def pickle_graph(gm: torch.fx.GraphModule) -> bytes:
    """The graph without the node metadata that holds live objects (module stacks), taken
    before tpuc's compile rewrites it. Stack traces (text) stay: the graph loaded from
    AOTAutograd's cache or a saved file lowers with the source locations it was traced with."""
    from torch.fx._graph_pickler import GraphPickler, Options

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k in _KEPT_METADATA}
    return GraphPickler.dumps(torch.fx.GraphModule(gm, graph), Options(ops_filter=None))


# Shapes and dtypes, which tpuc's importer reads, and the user's frames (source locations).
_KEPT_METADATA = ("val", "tensor_meta", "stack_trace")


def save_compiled(model, path, args: tuple, kwargs: dict | None = None, options=None, mode=None):
    """Compiles `model` (an `nn.Module` or a function) for inputs like `args`/`kwargs` with
    `backend="tpu"` (`fullgraph=True`, static shapes) and writes the compiled function to `path`.
    Returns the compiled function (callable like the model). Nothing is run.

    The file holds Dynamo's guards that can be checked in another process (input shapes, dtypes
    and strides, grad mode, module attributes such as `training`; not those on globals or object
    identity: `savable_guards`; pass `options={"guard_filter_fn": ...}` to choose). A call that fails them raises `RuntimeError` (no retrace: compile another shape
    with another file)."""
    options = dict(options or {})
    options.setdefault("guard_filter_fn", savable_guards)  # torch.compile takes it out of options
    is_module = isinstance(model, torch.nn.Module)
    # A module's forward is traced as a method bound to the model: the model itself is not saved
    # (its parameters are inputs), load_compiled binds it again.
    target = model.forward if is_module else model
    compiled = torch.compile(target, backend="tpu", fullgraph=True, dynamic=False, options=options, mode=mode)
    fn = compiled.aot_compile((tuple(args), dict(kwargs or {})))
    fn.save_compiled_function(str(path), external_data={"model": model} if is_module else None)
    return functools.partial(fn, model) if is_module else fn


def savable_guards(entries) -> list[bool]:
    """`save_compiled`'s guard filter: PyTorch's default for AOT precompile (no guard on a global
    or on something only this process has, such as an object's identity), also applied to the
    guards a kept guard is derived from (Hugging Face models have such guards)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsavable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (e.is_global or e.guard_type in unsavable or unsavable.intersection(e.derived_guard_types or ()))
        for e in entries
    ]


# Options given to load_compiled, over those saved with each graph (contextvars: per thread).
_LOAD_OPTIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tpuc_load_options", default=None)


def load_compiled(path, model=None, options=None):
    """Loads a function saved by `save_compiled`. For an `nn.Module`, pass the model (the same
    architecture; its current parameters are used). Neither Dynamo nor AOTAutograd trace: tpuc
    imports and lowers the saved graphs, and the executables come from the persistent cache when
    it holds them (else they are compiled). `options` override those saved (e.g. `cache_dir`,
    `plugin`)."""
    external = {"model": model} if model is not None else None
    token = _LOAD_OPTIONS.set(dict(options or {}))
    try:
        with open(Path(path), "rb") as f:
            fn = torch.compiler.load_compiled_function(f, external_data=external)
    finally:
        _LOAD_OPTIONS.reset(token)
    return functools.partial(fn, model) if model is not None else fn
