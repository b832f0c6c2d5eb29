"""The one road every compile takes, and where it ends (docs/architecture.md, "The one road").

`Road` is one compile's context: the options parsed once, the target (if any) and the plugin
and runtime resolved once, so that no step below looks them up again. Every graph then goes
the same way: AOTAutograd (backend.py), the preparation table (prepare.py), regions and
partitions (compile_hook.py), and one of the road's endings (`Road.ending`):

- `here`: compiled for and run on this machine's plugin (`CompiledGraph`);
- `device`: a target whose devices this machine has: the same, on the target's plugin, which
  finds the executables a target compile stored under the same keys;
- `target`: compiled for a topology this machine lacks (`targets.TargetGraph`), written to the
  cache; a call raises TargetUnavailableError (a precompile runs the graph in PyTorch);
- `stand_in`: a target's executables compiled as for `target`, and the same graphs, lowered by
  the target's rules, run on this machine's plugin (`targets.StandIn`): results here.

`torch.compile`, `tpuc.precompile` and `tpuc.save_compiled` are these endings reached from the
same backend (precompile drives calls over the buckets; saving keeps the graphs and their
executables in a file: saved.py).
"""

from __future__ import annotations

import dataclasses

from . import runtime, targets
from . import sharding as sharding_mod
from .compiled_graph import CompiledGraph
from .target_spec import parse as parse_target


class Road:
    """One compile's context (see the module's docstring). `opts`: the parsed options."""

    def __init__(self, opts):
        self.mesh = sharding_mod.parse_mesh(opts)
        mesh_size = self.mesh.size if self.mesh is not None else None
        self.spec = parse_target(opts.target) if opts.target is not None else None
        self.target = None  # the compile-only target (libtpu's topology), where one compiles
        self.runtime = None  # the runtime graphs run on here, where they run here
        if self.spec is None:
            self.ending_kind = "here"
            self.opts = opts
            self.runtime = runtime.get_runtime(opts.plugin, mesh_size, opts.plugin_options)
            self.family = runtime.plugin_family(runtime.resolve_plugin(opts.plugin), opts.plugin)
            return
        if self.mesh is not None and self.mesh.size > self.spec.chips:
            raise ValueError(
                f"tpuc: mesh {list(self.mesh.shape)} needs {self.mesh.size} devices; target {self.spec.name} "
                f"has {self.spec.chips} chips"
            )
        # A target's graphs lower entirely (no PyTorch pieces): an op without a rule raises.
        self.opts = dataclasses.replace(opts, fallback="error")
        self.family = self.spec.family
        if runtime.hardware_present(self.spec.family):
            self.ending_kind = "device"
            self.opts = dataclasses.replace(self.opts, plugin=self.spec.family)
            self.runtime = runtime.get_runtime(self.spec.family, None, opts.plugin_options)
            return
        # A missing libtpu or a bad topology fails here, before tracing.
        self.target = targets.get_target(self.spec)
        if opts.stand_in is None:
            self.ending_kind = "target"
            return
        self.ending_kind = "stand_in"
        # Started before tracing: the CPU plugin's known-answer check cannot run inside
        # AOTAutograd's compile (fake tensors).
        self.runtime = runtime.get_runtime(opts.stand_in, mesh_size, lower_for=self.spec.family)

    @property
    def regions_family(self) -> str:
        """What decides whether regions are inlined (regions.inlined): "target" for every
        ending of a target (its devices, its stand-in: the same split graphs), else the plugin's
        family."""
        return "target" if self.spec is not None else self.family

    @property
    def torch_kernels(self) -> bool:
        """Whether nodes may run through PyTorch's own kernels (torch_kernels.py): only running
        here on a plugin whose buffers are host memory."""
        return self.ending_kind == "here" and self.runtime.host_zero_copy

    def ending(self, gm, name: str, maxima=None, shard=None, free_layouts=None):
        """The boxed callable that ends the road for one prepared graph (or partition)."""
        if self.ending_kind in ("here", "device"):
            return CompiledGraph(gm, self.opts, name, self.runtime, maxima, shard, free_layouts).entry_point()
        tg = targets.TargetGraph(gm, self.opts, self.spec, name, maxima, shard)
        if self.ending_kind == "target":
            return tg
        return targets.StandIn(tg, CompiledGraph(gm, self.opts, name, self.runtime, maxima, shard))
