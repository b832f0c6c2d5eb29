"""SPMD over a device mesh: the `mesh` and `sharding` options, what each graph input is to the
model, and splitting tensors into per-device pieces and reassembling outputs.

The layouts themselves are chosen by the Rust sharding pass (`passes/src/sharding.rs`) at each
static shape; XLA's SPMD partitioner inserts the collectives. Whatever layout the pass picks, this
module splits inputs and reassembles outputs by exactly that layout, so results do not depend
on the strategy, only memory and speed do.
"""

from __future__ import annotations

import math
import re
import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import counters, residency

ROLES = ("parameter", "buffer", "data", "other")


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def parse_mesh(opts) -> Mesh | None:
    """The mesh of `opts`, or None (one device). Also checks that `sharding` fits it."""
    if opts.mesh is None:
        if opts.sharding != "replicated":
            raise ValueError(
                f"tpuc: option 'sharding' {opts.sharding!r} needs a device mesh, e.g. "
                'options={"mesh": {"shape": [4], "axes": ["data"]}, ...}'
            )
        return None
    mesh = Mesh(tuple(int(s) for s in opts.mesh["shape"]), tuple(str(a) for a in opts.mesh["axes"]))
    if len(set(mesh.axes)) != len(mesh.axes):
        raise ValueError(f"tpuc: mesh axes {list(mesh.axes)} repeat a name")
    if isinstance(opts.sharding, dict):
        for key, spec in opts.sharding.items():
            spec_indices(spec, mesh, f"sharding[{key!r}]")
    return mesh


def spec_indices(spec, mesh: Mesh, what: str) -> list[list[int]]:
    """A user spec (`("data", None)`, an entry may also be a tuple of axis names) as per-dim
    lists of mesh axis indices."""
    if not isinstance(spec, list | tuple):
        raise ValueError(
            f"tpuc: {what} = {spec!r}: expected a tuple with one entry per dim "
            "(a mesh axis name, a tuple of names, or None)"
        )
    out = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        idx = []
        for name in names:
            if name not in mesh.axes:
                raise ValueError(
                    f"tpuc: {what} = {spec!r}: the mesh has no axis {name!r} (axes {list(mesh.axes)})"
                )
            idx.append(mesh.axes.index(name))
        out.append(idx)
    return out


_PART = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def _optimizer_state(gm: torch.fx.GraphModule, name: str) -> bool:
    """Whether the Dynamo graph's buffer `name` is an optimizer's state (a whole training step's
    momentum, `exp_avg`, ...): Dynamo installs `opt.state[p][key]` as a buffer whose source reads
    `G['opt'].state[...]`. fsdp splits such state like the parameter it belongs to; a module's
    buffer stays whole (a module buffer misread as state would only be split, never wrong)."""
    src = getattr(gm, "_param_name_to_source", {}).get(name)
    text = getattr(src, "name", None)
    text = text() if callable(text) else text
    return isinstance(text, str) and ".state[" in text and "._buffers[" not in text


def _source_text(node) -> str | None:
    """The Dynamo source of a placeholder as text: `L['self']._modules['fc1']._parameters['weight']`."""
    src = getattr(node.meta.get("grapharg"), "source", None)
    if src is None:
        return None
    name = getattr(src, "name", None)  # a property in torch 2.15, a method in some versions
    name = name() if callable(name) else name
    return name if isinstance(name, str) else None


def source_name(text: str | None) -> str | None:
    """A readable name from a source text: `L['self']._modules['fc1']._parameters['weight']` ->
    `fc1.weight`, `L['x']` -> `x`, `L['args'][0]` -> `args[0]`."""
    if text is None:
        return None
    if "._parameters[" in text or "._buffers[" in text:
        rest = text.split("]", 1)[1] if text.startswith("L[") else text
        return ".".join(m.group(1) for m in _PART.finditer(rest))
    m = re.fullmatch(r"L\['([^']+)'\](.*)", text)
    if m:
        return m.group(1) + m.group(2)
    return text


@dataclass
class Context:
    """What the forward and backward graphs of one Dynamo graph share: the mesh and strategy,
    each forward input's role and name, the batch size, and the specs the forward graph gave its
    inputs (the backward graph gives each parameter's gradient its parameter's spec)."""

    mesh: Mesh
    strategy: str
    explicit: dict = field(default_factory=dict)
    roles: list = field(default_factory=list)  # per forward input: (role, name)
    batch: int | None = None
    forward_specs: dict = field(default_factory=dict)  # forward input index -> spec
    # Forward output node name -> spec: the backward graph's input of the same name is that tensor
    # (AOTAutograd names saved tensors alike), so it is split the same way and not regathered.
    saved_specs: dict = field(default_factory=dict)

    @classmethod
    def for_dynamo_graph(cls, gm: torch.fx.GraphModule, example_inputs, mesh: Mesh, sharding) -> Context:
        strategy = sharding if isinstance(sharding, str) else "replicated"
        explicit = dict(sharding) if isinstance(sharding, dict) else {}
        roles = [("parameter", name) for name, _ in gm.named_parameters(remove_duplicate=False)]
        roles += [
            ("parameter" if _optimizer_state(gm, name) else "buffer", name)
            for name, _ in gm.named_buffers(remove_duplicate=False)
        ]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        batch = None
        for node, ex in zip(placeholders, example_inputs, strict=False):
            text = _source_text(node)
            name = source_name(text) or node.name
            if not isinstance(ex, torch.Tensor):
                roles.append(("other", name))
            elif isinstance(ex, torch.nn.Parameter) or "._parameters[" in (text or ""):
                roles.append(("parameter", name))
            elif "._buffers[" in (text or ""):
                roles.append(("buffer", name))
            else:
                roles.append(("data", name))
                if batch is None and ex.dim() >= 1:
                    batch = int(ex.shape[0])
        ctx = cls(mesh, strategy, explicit, roles, batch)
        ctx.check_explicit_keys()
        return ctx

    def check_explicit_keys(self) -> None:
        data = [name for role, name in self.roles if role == "data"]
        named = {name for _, name in self.roles}
        for key in self.explicit:
            if isinstance(key, int):
                if not 0 <= key < len(data):
                    raise ValueError(
                        f"tpuc: sharding spec for input {key}: the model has {len(data)} tensor input(s) "
                        f"({', '.join(data)})"
                    )
            elif key not in named:
                raise ValueError(
                    f"tpuc: sharding spec for {key!r}: no input or parameter of that name; names are "
                    f"{', '.join(sorted(named))}"
                )

    def fixed_spec(self, index: int):
        """The explicit spec for forward input `index`, as axis indices, or None."""
        role, name = self.roles[index]
        spec = self.explicit.get(name)
        if spec is None and role == "data":
            spec = self.explicit.get(sum(1 for r, _ in self.roles[:index] if r == "data"))
        return None if spec is None else spec_indices(spec, self.mesh, f"sharding[{name!r}]")


class ShardedGraph:
    """The sharding side of one CompiledGraph: the request the Rust pass gets at each compile,
    and running the partitioned executable with inputs split and outputs reassembled."""

    def __init__(
        self,
        ctx: Context,
        kind: str,
        gm: torch.fx.GraphModule,
        graph_inputs,
        output_kinds,
        runtime,
        residency: tuple[bool, bool] = (True, False),
    ):
        self.ctx = ctx
        # (whether inputs may stay resident, whether resident pieces may be copies): see
        # residency.keeps_resident.
        self.residency = residency
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        num_placeholders = len(placeholders)
        self.input_names = [n.name for n in placeholders]
        out_args = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        out_args = out_args if isinstance(out_args, list | tuple) else [out_args]
        self.output_names = [a.name if isinstance(a, torch.fx.Node) else None for a in out_args]
        # "forward", "backward" or "partition" (a piece of a graph split around eager ops, whose
        # inputs are not the model's). A forward graph whose inputs do not line up with the Dynamo
        # graph's is treated like a partition: every input "other".
        if kind == "forward" and num_placeholders != len(ctx.roles):
            kind = "partition"
        self.kind = kind
        self.graph_inputs = graph_inputs
        self.output_kinds = output_kinds
        self.runtime = runtime
        self.slots: dict[int, _ResidentShards] = {}
        # id(executable) -> Executable.shard_pieces(); the executables live as long as the graph.
        self.pieces: dict[int, tuple] = {}
        self.lock = threading.Lock()
        _live.add(self)

    def request(self) -> dict:
        """The `sharding` argument of Runtime.compile for this graph."""
        ctx = self.ctx
        inputs = []
        for i, (kind, *_rest) in enumerate(self.graph_inputs):
            if kind != "tensor":
                continue
            if self.kind == "forward" and i < len(ctx.roles):
                role, name = ctx.roles[i]
                inputs.append((role, name, ctx.fixed_spec(i)))
            elif self.kind == "backward" and i < len(self.input_names):
                name = self.input_names[i]
                inputs.append(("other", f"saved tensor {name}", ctx.saved_specs.get(name)))
            else:
                inputs.append(("other", f"{self.kind} input {i}", None))
        outputs = []
        for j, (kind, _value) in enumerate(self.output_kinds):
            if kind != "tensor":
                continue
            if self.kind == "backward" and j < len(ctx.roles) and ctx.roles[j][0] == "parameter":
                outputs.append(("parameter", f"gradient of {ctx.roles[j][1]}", ctx.forward_specs.get(j)))
            else:
                outputs.append(("other", f"{self.kind} output {j}", None))
        strategy = ctx.strategy
        if self.kind == "backward" and strategy == "tensor_parallel":
            strategy = "replicated"  # parameters' gradients are fixed above; the rest stays whole
        return {
            "mesh_shape": list(ctx.mesh.shape),
            "mesh_axes": list(ctx.mesh.axes),
            "strategy": strategy,
            "inputs": inputs,
            "outputs": outputs,
            "batch": ctx.batch,
        }

    def compiled(self, exe) -> None:
        """Records where each device's pieces of `exe`'s inputs and outputs lie (used at every
        call), and for a forward graph its specs, for the backward graph."""
        self.pieces[id(exe)] = exe.shard_pieces()
        self.record_specs(exe.sharding)

    def record_specs(self, sharding) -> None:
        """For a forward graph: its inputs' and outputs' specs (`(mesh shape, axes, input
        specs, output specs)` as compiled), which its backward graph's request reads."""
        if self.kind != "forward":
            return
        _shape, _axes, in_specs, out_specs = sharding
        tensor_inputs = [i for i, k in enumerate(self.graph_inputs) if k[0] == "tensor"]
        for i, spec in zip(tensor_inputs, in_specs, strict=False):
            self.ctx.forward_specs[i] = spec
        for j, (kind, value) in enumerate(self.output_kinds):
            if j >= len(self.output_names) or not self.output_names[j]:
                continue
            if kind == "tensor":
                self.ctx.saved_specs[self.output_names[j]] = out_specs[int(value)]
            elif kind == "input":  # an input saved as it came: laid out as the forward took it
                self.ctx.saved_specs[self.output_names[j]] = self.ctx.forward_specs.get(int(value))

    def run(self, exe, args: list, out_types: list, host_array) -> list:
        """Runs `exe` on every device of the mesh; `args`: one tensor per executable input."""
        in_layouts, out_layouts = self.pieces[id(exe)]
        n = self.ctx.mesh.size
        per_device: list[list] = [[None] * len(args) for _ in range(n)]
        keep = []
        for i, (t, layout) in enumerate(zip(args, in_layouts, strict=True)):
            resident = self._resident(i, t, layout, host_array)
            if resident is not None:
                for d in range(n):
                    per_device[d][i] = resident.buffers[d]
                continue
            pieces = split(t, layout)
            keep.append(pieces)
            for d in range(n):
                per_device[d][i] = host_array(pieces[d])
        outs = []
        out_arrays: list[list] = [[None] * len(out_types) for _ in range(n)]
        for k, ((shape, dtype), layout) in enumerate(zip(out_types, out_layouts, strict=True)):
            pieces = {}
            for d, (_offsets, piece_shape, first_copy) in enumerate(layout):
                if first_copy:
                    pieces[d] = torch.empty(piece_shape, dtype=dtype)
                    out_arrays[d][k] = host_array(pieces[d])
            outs.append((shape, dtype, layout, pieces))
        exe.run_sharded(per_device, out_arrays)
        counters.count_execution()
        return [assemble(shape, dtype, layout, pieces) for shape, dtype, layout, pieces in outs]

    def _resident(self, i: int, t: torch.Tensor, layout, host_array):
        """Per-device buffers of input `i` kept on the devices while the same tensor comes back
        with the same memory and version (parameters), cached the second time its storage is
        seen, under the rules of unsharded graphs (`residency`): where device memory is host
        memory, only pieces that are the tensor's own memory stay resident."""
        enabled, copies = self.residency
        if not enabled:
            return None
        slot = self.slots.get(i)
        ptr, storage = t.data_ptr(), t.untyped_storage()
        if slot is not None and slot.layout == layout and residency.still_resident(slot, t, ptr, storage):
            return slot
        if slot is not None and slot.ref is not None and slot.ref() is storage:
            if slot.copied:
                return None  # its pieces are copies (see below)
            pieces = split(t, layout)
            buffers = [self.runtime.upload(host_array(p), d) for d, p in enumerate(pieces)]
            for _ in buffers:
                counters.count_upload()
            # Every piece a view of `t` computed on in place: live values, whatever writes them.
            aliased = all(
                b.aliases_host and p.untyped_storage() is storage
                for p, b in zip(pieces, buffers, strict=True)
            )
            if not (copies or aliased):
                slot.copied = True  # a copy could go stale: split per call instead
                return None
            slot.tensor, slot.version, slot.ptr, slot.storage = t, t._version, ptr, storage
            slot.layout, slot.aliased, slot.pieces, slot.buffers = layout, aliased, pieces, buffers
            return slot
        fresh = _ResidentShards()
        fresh.ref = weakref.ref(storage)
        self.slots[i] = fresh
        return None

    def resident_bytes(self) -> list[int]:
        """Bytes of resident input pieces per device."""
        n = self.ctx.mesh.size
        out = [0] * n
        for slot in self.slots.values():
            if slot.pieces is None or slot.tensor is None:
                continue
            for d, p in enumerate(slot.pieces):
                out[d] += p.nbytes
        return out


class _ResidentShards:
    __slots__ = (
        "ref",
        "copied",
        "tensor",
        "version",
        "ptr",
        "storage",
        "aliased",
        "layout",
        "pieces",
        "buffers",
    )

    def __init__(self):
        self.ref = self.tensor = self.storage = self.layout = self.pieces = self.buffers = None
        self.version, self.ptr, self.aliased, self.copied = -1, 0, False, False


_live: weakref.WeakSet = weakref.WeakSet()


def resident_bytes() -> list[int]:
    """Bytes of parameters (and other inputs kept resident) that sharded compiled graphs hold on
    each device, summed over the live graphs; index = device."""
    total: list[int] = []
    for g in list(_live):
        for d, b in enumerate(g.resident_bytes()):
            if d >= len(total):
                total.extend([0] * (d + 1 - len(total)))
            total[d] += b
    return total


def _slices(offsets, shape) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))


def split(t: torch.Tensor, layout) -> list[torch.Tensor]:
    """Each device's contiguous piece of `t` (`layout`: Executable.shard_pieces() of one input);
    a tensor every device holds whole is shared."""
    if t.device.type != "cpu":
        t = t.cpu()
    if all(list(shape) == list(t.shape) for _offsets, shape, _first in layout):
        whole = t.contiguous()
        return [whole] * len(layout)
    return [t[_slices(offsets, shape)].contiguous() for offsets, shape, _first in layout]


def assemble(shape, dtype, layout, pieces: dict) -> torch.Tensor:
    """The whole tensor from the first copy of each piece (`pieces`: device -> tensor)."""
    if len(pieces) == 1:
        (piece,) = pieces.values()
        if tuple(piece.shape) == tuple(shape):
            return piece
    out = torch.empty(shape, dtype=dtype)
    for d, piece in pieces.items():
        offsets, piece_shape, _first = layout[d]
        out[_slices(offsets, piece_shape)] = piece
    return out
