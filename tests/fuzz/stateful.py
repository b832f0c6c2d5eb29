"""Stateful fuzz programs: what ordinary PyTorch code changes under a compiled module.

A `ModuleProgram` is a small random `nn.Module` (Embedding / Linear / Conv1d / LayerNorm /
BatchNorm1d / an affine block with buffers / a counter buffer that forward increments, with
activations in between), built from the program's seed, and a list of calls. Before each call
(after the first) a few mutations of the module's state are applied, each a different way user
code changes parameters and buffers: `p.data = ...`, `p.set_(...)`, in-place updates with and
without a `_version` bump, storage free and realloc (FSDP2), `torch.utils.swap_tensors`,
`load_state_dict` (copying and assigning), dtype round trips, parameter and buffer reassignment,
train/eval switches, a call in float64. Each call's input is fresh or the previous call's tensor
object, possibly changed in place (with or without a version bump) or given a new storage.

Two copies of the module are built from the same seed: one is compiled with tpuc, one runs eagerly;
every mutation is applied to both, with the same values. After every call the outputs, every
parameter and buffer (forward may update buffers), the inputs and, after a backward, the gradients
must agree with eager (runner.compare's tolerances). A failure that `backend="aot_eager"` shows too
is PyTorch's, not tpuc's: it is classified "torch" and not counted as a tpuc failure.

Generation is deterministic per seed, and eager validates each program: a mutation that eager
PyTorch rejects at that point is dropped.

`generate_stateful(seed)` is the whole new family: these module programs for even seeds, programs
of gen.py with custom ops placed at random positions (customops.py) for odd seeds.
"""

from __future__ import annotations

import collections
import random
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from fuzz.runner import OPTIONS, Outcome, _classify, compare

# -- the mutations -----------------------------------------------------------------------------

PARAM_KINDS = {
    # kind: (weight, Python that the mutation runs, for reproducers; p = the parameter, new = a
    # fresh tensor of p's shape and dtype)
    "data_assign": (3, "p.data = new"),
    "data_clone": (2, "p.data = p.data.clone()"),
    "set_": (2, "with torch.no_grad(): p.set_(new)"),
    "inplace": (2, "with torch.no_grad(): p.mul_(c) | p.add_(new) | p.copy_(new)"),
    "data_inplace": (2, "p.data.mul_(c) | p.data.copy_(new)  # no _version bump"),
    "storage_resize": (
        2,
        "p.untyped_storage().resize_(0); p.untyped_storage().resize_(n); with torch.no_grad(): p.copy_(new)",
    ),
    "storage_resize_data": (
        1,
        "p.untyped_storage().resize_(0); p.untyped_storage().resize_(n); p.data.copy_(new)",
    ),
    "data_strided": (1, "p.data = new, non-contiguous or at a storage offset"),
    "swap_tensors": (2, "torch.utils.swap_tensors(p, nn.Parameter(new))"),
    "param_reassign": (1, "owner.<name> = nn.Parameter(new)"),
    "requires_grad": (1, "p.requires_grad_(not p.requires_grad)"),
}
BUFFER_KINDS = {
    "buffer_inplace": (2, "b.mul_(c) | b.add_(c) | b.copy_(new)"),
    "buffer_data": (2, "b.data = new"),
    "buffer_reassign": (1, "owner.<name> = new"),
}
MODEL_KINDS = {
    "double_roundtrip": (2, "model.double(); model.float()"),
    "half_roundtrip": (1, "model.half(); model.float()"),
    "bf16_roundtrip": (1, "model.bfloat16(); model.float()"),
    "load_state_dict": (2, "model.load_state_dict(new_state)"),
    "load_state_dict_assign": (2, "model.load_state_dict(new_state, assign=True)"),
    "train_eval": (1, "model.train(not model.training)"),
    "call_double": (1, "model.double(); call with x.double(); model.float()"),
}
INPUT_POLICIES = {
    # policy: (weight, what happens to the input before the call)
    "fresh": (8, "x = new"),
    "reuse": (3, "x: the previous call's tensor"),
    "reuse_inplace": (2, "x.copy_(new)"),
    "reuse_data_copy": (2, "x.data.copy_(new)  # no _version bump"),
    "reuse_data_assign": (2, "x.data = new"),
    "reuse_set": (1, "x.set_(new)"),
}
ALL_KINDS = {**PARAM_KINDS, **BUFFER_KINDS, **MODEL_KINDS}


def _mix(*parts: int) -> int:
    h = 0x9E3779B1
    for p in parts:
        h = (h * 1000003 + int(p) + 0x7F4A7C15) % (2**62)
    return h


def _new_like(t: torch.Tensor, g: torch.Generator, name: str = "") -> torch.Tensor:
    """Fresh values for a parameter or buffer of `t`'s shape and dtype."""
    if not t.dtype.is_floating_point:
        return t.clone()
    v = torch.randn(t.shape, generator=g) * 0.5
    if name.endswith("running_var"):
        v = v.abs() + 0.5
    return v.to(t.dtype)


def _strided(new: torch.Tensor, arg: int) -> torch.Tensor:
    """`new`'s values in a tensor that is not its own contiguous storage: every other element of
    the last dim of a wider tensor (arg even), or at storage offset 1 of a longer one (arg odd)."""
    if arg % 2 == 0 and new.dim():
        wide = torch.zeros(*new.shape[:-1], 2 * new.shape[-1], dtype=new.dtype)
        wide[..., ::2] = new
        return wide[..., ::2]
    flat = torch.zeros(new.numel() + 2, dtype=new.dtype)
    flat[1:-1] = new.flatten()
    return flat[1:-1].view(new.shape)


def mutation_code(kind: str, target: str, arg: int) -> str:
    """The Python a mutation runs (`model` the module, `new` fresh values of the target's shape)."""
    t = f"model.{target}"
    c = 0.75 if target.endswith("running_var") else 0.5 + arg
    code = {
        "data_assign": f"{t}.data = new",
        "data_clone": f"{t}.data = {t}.data.clone()",
        "set_": f"with torch.no_grad(): {t}.set_(new)",
        "inplace": f"with torch.no_grad(): {t}." + [f"mul_({0.5 + arg})", "add_(new)", "copy_(new)"][arg % 3],
        "data_inplace": f"{t}.data." + ["mul_(-1.5)", "copy_(new)"][arg % 2] + "  # no _version bump",
        "storage_resize": f"{t}.untyped_storage().resize_(0); {t}.untyped_storage().resize_(nbytes); "
        f"with torch.no_grad(): {t}.copy_(new)",
        "storage_resize_data": f"{t}.untyped_storage().resize_(0); {t}.untyped_storage().resize_(nbytes); "
        f"{t}.data.copy_(new)  # no _version bump",
        "data_strided": f"{t}.data = "
        + (
            "wide[..., ::2]  # new's values, non-contiguous (at storage offset 1 if 0-d)"
            if arg % 2 == 0
            else "longer[1:-1].view(new.shape)  # new's values at storage offset 1"
        ),
        "swap_tensors": f"torch.utils.swap_tensors({t}, nn.Parameter(new))",
        "param_reassign": f"{t} = nn.Parameter(new)",
        "requires_grad": f"{t}.requires_grad_(not {t}.requires_grad)",
        "buffer_inplace": f"{t}." + [f"mul_({c})", f"add_({c})", "copy_(new)"][arg % 3],
        "buffer_data": f"{t}.data = new",
        "buffer_reassign": f"{t} = new",
        "load_state_dict": "model.load_state_dict({name: new ...})",
        "load_state_dict_assign": "model.load_state_dict({name: new ...}, assign=True)",
    }.get(kind)
    return code or ALL_KINDS[kind][1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def apply_mutation(model: nn.Module, state: dict, kind: str, target: str, arg: int, seed: int) -> None:
    """Applies one mutation to `model` (values from a generator seeded with `seed`). `state`
    holds what lasts past the mutation (a pending float64 call)."""
    g = torch.Generator().manual_seed(seed)
    if kind in PARAM_KINDS:
        p = model.get_parameter(target)
        new = _new_like(p, g, target)
        if kind == "data_assign":
            p.data = new
        elif kind == "data_clone":
            p.data = p.data.clone()
        elif kind == "set_":
            with torch.no_grad():
                p.set_(new)
        elif kind == "inplace":
            with torch.no_grad():
                [lambda: p.mul_(0.5 + arg), lambda: p.add_(new), lambda: p.copy_(new)][arg % 3]()
        elif kind == "data_inplace":
            [lambda: p.data.mul_(-1.5), lambda: p.data.copy_(new)][arg % 2]()
        elif kind in ("storage_resize", "storage_resize_data"):
            n = p.untyped_storage().nbytes()
            p.untyped_storage().resize_(0)
            p.untyped_storage().resize_(n)
            if kind == "storage_resize":
                with torch.no_grad():
                    p.copy_(new)
            else:
                p.data.copy_(new)
        elif kind == "data_strided":
            p.data = _strided(new, arg)
        elif kind == "swap_tensors":
            torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=p.requires_grad))
        elif kind == "param_reassign":
            owner, leaf = _owner(model, target)
            setattr(owner, leaf, nn.Parameter(new, requires_grad=p.requires_grad))
        elif kind == "requires_grad":
            p.requires_grad_(not p.requires_grad)
        return
    if kind in BUFFER_KINDS:
        b = model.get_buffer(target)
        new = _new_like(b, g, target)
        if kind == "buffer_inplace":
            c = 0.75 if target.endswith("running_var") else 0.5 + arg
            [lambda: b.mul_(c), lambda: b.add_(c), lambda: b.copy_(new)][arg % 3]()
        elif kind == "buffer_data":
            b.data = new
        else:
            owner, leaf = _owner(model, target)
            setattr(owner, leaf, new)
        return
    if kind in ("double_roundtrip", "half_roundtrip", "bf16_roundtrip"):
        {"double_roundtrip": model.double, "half_roundtrip": model.half, "bf16_roundtrip": model.bfloat16}[
            kind
        ]()
        model.float()
    elif kind in ("load_state_dict", "load_state_dict_assign"):
        sd = {k: _new_like(v, g, k) for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=kind == "load_state_dict_assign")
    elif kind == "train_eval":
        model.train(not model.training)
    elif kind == "call_double":
        model.double()
        state["double"] = True
    else:
        raise ValueError(f"unknown mutation kind {kind}")


# -- the modules -------------------------------------------------------------------------------


class Conv1dLast(nn.Module):
    """Conv1d over the middle dim of a (B, L, C) tensor (length kept)."""

    def __init__(self, cin, cout, k, bias):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, padding=k // 2, bias=bias)

    def forward(self, x):
        return self.conv(x.transpose(-1, -2)).transpose(-1, -2)


class BatchNormLast(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.bn = nn.BatchNorm1d(n)

    def forward(self, x):
        return self.bn(x) if x.dim() == 2 else self.bn(x.transpose(1, 2)).transpose(1, 2)


class Affine(nn.Module):
    """A parameter and two buffers."""

    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(n) * 0.5 + 1)
        self.register_buffer("scale", torch.rand(n) + 0.5)
        self.register_buffer("shift", torch.randn(n) * 0.25)

    def forward(self, x):
        return x * self.scale * self.gain + self.shift


class Counter(nn.Module):
    """A buffer that forward increments (a mutated input of the compiled graph)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return x + self.steps * 0.125


ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def build(program: ModuleProgram) -> nn.Module:
    """The program's module (same parameters for the same seed)."""
    torch.manual_seed(program.seed)
    spec = program.input
    f = spec["shape"][-1] if spec["kind"] == "float" else None
    layers = {}
    for name, kind, *a in program.blocks:
        if kind == "embed":
            layers[name] = nn.Embedding(spec["vocab"], a[0], padding_idx=a[1])
            f = a[0]
        elif kind == "linear":
            layers[name] = nn.Linear(f, a[0], bias=a[1])
            f = a[0]
        elif kind == "conv1d":
            layers[name] = Conv1dLast(f, a[0], a[1], a[2])
            f = a[0]
        elif kind == "layernorm":
            layers[name] = nn.LayerNorm(f, elementwise_affine=a[0])
        elif kind == "bn":
            layers[name] = BatchNormLast(f)
        elif kind == "affine":
            layers[name] = Affine(f)
        elif kind == "counter":
            layers[name] = Counter()
        elif kind == "act":
            layers[name] = ACTS[a[0]]()
        else:
            raise ValueError(kind)
    model = nn.Sequential(collections.OrderedDict(layers)) if layers else nn.Sequential(nn.Identity())
    model.train(not program.eval)
    return model


@dataclass
class ModuleProgram:
    seed: int
    input: dict  # {"kind": "float", "shape": [...]} or {"kind": "tokens", "shape": [B, L], "vocab": V}
    blocks: list  # [name, kind, *args]
    eval: bool
    steps: list = field(default_factory=list)  # per call: {"mut": [[kind, target, arg]], "input", "grad"}

    def to_dict(self) -> dict:
        return {
            "family": "module",
            "seed": self.seed,
            "input": self.input,
            "blocks": self.blocks,
            "eval": self.eval,
            "steps": self.steps,
        }

    @staticmethod
    def from_dict(d: dict) -> ModuleProgram:
        return ModuleProgram(d["seed"], d["input"], [list(b) for b in d["blocks"]], d["eval"], d["steps"])

    def kinds(self) -> list[str]:
        """Every mutation kind and non-trivial input policy of the program."""
        out = []
        for k in range(len(self.steps)):
            out += blame(self.steps, k)
        return sorted(set(out))

    def describe(self) -> str:
        """The program in words and Python, for reports and reproducers."""
        lines = [
            f"model (seed {self.seed}, {'eval' if self.eval else 'train'} mode): "
            + ", ".join(f"{n}={k}{tuple(a) if a else ''}" for n, k, *a in self.blocks),
            f"input: {self.input['kind']} {self.input['shape']}"
            + (f" < {self.input['vocab']}" if self.input["kind"] == "tokens" else ""),
        ]
        for k, s in enumerate(self.steps):
            for kind, target, arg in s["mut"]:
                lines.append(f"  {mutation_code(kind, target, arg)}  # {kind}")
            pol = s["input"]
            lines.append(f"call {k} ({s['grad']}), input {pol}: {INPUT_POLICIES[pol][1]}")
        return "\n".join(lines)


def blame(steps: list, k: int) -> list[str]:
    """What changed right before call `k`: its mutation kinds and its input policy (unless
    plain), and a float64 call's return to float32 (`model.float()` after call k - 1)."""
    step = steps[k]
    out = [m[0] for m in step["mut"]]
    if k and any(m[0] == "call_double" for m in steps[k - 1]["mut"]):
        out.append("call_double")
    if step["input"] not in ("fresh", "reuse"):
        out.append("input:" + step["input"])
    return sorted(set(out), key=out.index)


# -- generation --------------------------------------------------------------------------------


def _weighted(rng: random.Random, table: dict) -> str:
    names = list(table)
    return rng.choices(names, weights=[table[n][0] for n in names])[0]


def _random_blocks(rng: random.Random) -> tuple[dict, list]:
    b = rng.randint(2, 3)
    r = rng.random()
    blocks: list = []
    if r < 0.25:
        inp = {"kind": "tokens", "shape": [b, rng.randint(1, 4)], "vocab": rng.randint(3, 9)}
        blocks.append(["b0", "embed", rng.randint(2, 6), rng.choice([None, None, 0])])
        rank = 3
    elif r < 0.6:
        inp = {"kind": "float", "shape": [b, rng.randint(1, 4), rng.randint(1, 6)]}
        rank = 3
    else:
        inp = {"kind": "float", "shape": [b, rng.randint(1, 6)]}
        rank = 2
    for _ in range(rng.randint(1, 4)):
        name = f"b{len(blocks)}"
        r = rng.random()
        if r < 0.3:
            blocks.append([name, "linear", rng.randint(1, 6), rng.random() < 0.8])
        elif r < 0.4 and rank == 3:
            blocks.append([name, "conv1d", rng.randint(1, 5), rng.choice([1, 3]), rng.random() < 0.8])
        elif r < 0.55:
            blocks.append([name, "layernorm", rng.random() < 0.8])
        elif r < 0.65:
            blocks.append([name, "bn"])
        elif r < 0.8:
            blocks.append([name, "affine"])
        elif r < 0.87:
            blocks.append([name, "counter"])
        else:
            blocks.append([name, "act", rng.choice(sorted(ACTS))])
    return inp, blocks


def _random_steps(rng: random.Random, model: nn.Module, calls: int, only=None) -> list | None:
    """Random calls and mutations; `only`: the mutation kinds and "input:<policy>"s allowed
    (None if the model has nothing they apply to)."""
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, b in model.named_buffers() if b.dtype.is_floating_point]
    kinds = dict(MODEL_KINDS)
    if params:
        kinds.update(PARAM_KINDS)
    if buffers:
        kinds.update(BUFFER_KINDS)
    policies = INPUT_POLICIES
    if only is not None:
        kinds = {k: v for k, v in kinds.items() if k in only}
        policies = {
            p: v for p, v in INPUT_POLICIES.items() if p in ("fresh", "reuse") or f"input:{p}" in only
        }
        if not kinds and len(policies) == 2:
            return None
    # One grad mode for most calls: each switch is a recompilation.
    base = rng.choices(["no_grad", "grad", "backward"], weights=[6, 2, 2])[0]
    steps = []
    for k in range(calls):
        muts = []
        if k:
            for _ in range(rng.choices([0, 1, 2], weights=[2, 6, 2])[0] if kinds else 0):
                kind = _weighted(rng, kinds)
                target = (
                    rng.choice(params)
                    if kind in PARAM_KINDS
                    else rng.choice(buffers)
                    if kind in BUFFER_KINDS
                    else ""
                )
                muts.append([kind, target, rng.randrange(6)])
        grad = base if rng.random() < 0.95 else rng.choice(["no_grad", "grad", "backward"])
        policy = _weighted(rng, policies) if k else "fresh"
        steps.append({"mut": muts, "input": policy, "grad": grad})
    return steps


def generate_module(seed: int, only=None) -> ModuleProgram:
    """The module program of `seed`: random blocks and calls, validated by eager PyTorch.
    `only`: restrict the mutations to these kinds (and "input:<policy>" names)."""
    for attempt in range(50):
        rng = random.Random(f"module/{seed}" + (f"/{attempt}" if attempt else ""))
        inp, blocks = _random_blocks(rng)
        program = ModuleProgram(seed, inp, blocks, eval=rng.random() < 0.6)
        model = build(program)
        # Calls are cheap next to compiling: enough of them that a tensor is resident (uploaded
        # the second time it is seen) when a mutation comes.
        steps = _random_steps(rng, model, rng.randint(4, 6), only)
        if steps is not None:
            break
    program.steps = steps or []
    for _ in range(20):
        bad = eager_check(program)
        if bad is None:
            break
        k, j = bad
        if j is None:  # the call itself failed eagerly: a plain call instead
            program.steps[k] = {"mut": program.steps[k]["mut"], "input": "fresh", "grad": "no_grad"}
            if k and eager_check(program) == bad:
                program.steps[k]["mut"] = []
        else:
            del program.steps[k]["mut"][j]
    return program


# -- running -----------------------------------------------------------------------------------


def _input_value(program: ModuleProgram, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spec = program.input
    if spec["kind"] == "tokens":
        return torch.randint(0, spec["vocab"], spec["shape"], generator=g)
    return torch.randn(spec["shape"], generator=g)


def _next_input(program: ModuleProgram, x, policy: str, seed: int):
    """The input object of a call: `x` (the previous call's) changed by `policy`, or a new one."""
    new = _input_value(program, seed)
    if x is None or policy == "fresh":
        return new
    if policy == "reuse_inplace":
        x.copy_(new)
    elif policy == "reuse_data_copy":
        x.data.copy_(new)
    elif policy == "reuse_data_assign":
        x.data = new
    elif policy == "reuse_set":
        x.set_(new)
    return x


_GRAD_MODES = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "backward": torch.enable_grad}


def _call(model, x, step, double: bool):
    """One call of `model` (compiled or not) in the step's grad mode; backward when asked."""
    arg = x.double() if double and x.dtype.is_floating_point else x
    with _GRAD_MODES[step["grad"]]():
        out = model(arg)
    if step["grad"] == "backward" and out.requires_grad:
        out.double().sum().backward()
    return out


def eager_check(program: ModuleProgram) -> tuple[int, int | None] | None:
    """Runs `program` eagerly: None, or (call, mutation index or None for the call) of the first
    thing eager PyTorch rejects."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(program)
        except Exception:  # noqa: BLE001 - a shrinking candidate without its embedding
            return 0, None
        x = None
        for k, step in enumerate(program.steps):
            state: dict = {}
            for j, (kind, target, arg) in enumerate(step["mut"]):
                try:
                    apply_mutation(model, state, kind, target, arg, _mix(program.seed, k, j))
                except Exception:  # noqa: BLE001
                    return k, j
            try:
                x = _next_input(program, x, step["input"], _mix(program.seed, k, 99))
                _call(model, x, step, state.get("double", False))
            except Exception:  # noqa: BLE001
                return k, None
            if state.get("double"):
                model.float()
            model.zero_grad(set_to_none=True)
    return None


def compile_module(model: nn.Module, backend: str):
    if backend == "tpu":
        return torch.compile(model, backend="tpu", dynamic=False, options=OPTIONS)
    return torch.compile(model, backend=backend, dynamic=False)


def _compare_state(ref: nn.Module, mod: nn.Module) -> str | None:
    sr, sm = ref.state_dict(keep_vars=True), mod.state_dict(keep_vars=True)
    if list(sr) != list(sm):
        return f"state keys {list(sm)} vs eager {list(sr)}"
    for name, e in sr.items():
        a = sm[name]
        diff = compare((a.detach(),), (e.detach(),))
        if diff is not None:
            return f"{name}: {diff.removeprefix('output 0: ')}"
        if isinstance(e, nn.Parameter) != isinstance(a, nn.Parameter) or e.requires_grad != a.requires_grad:
            return f"{name}: Parameter/requires_grad differs from eager"
    return None


def _compare_grads(ref: nn.Module, mod: nn.Module) -> str | None:
    for (name, e), (_, a) in zip(ref.named_parameters(), mod.named_parameters(), strict=True):
        if (e.grad is None) != (a.grad is None):
            return f"{name}.grad: {'None' if a.grad is None else 'a tensor'} vs eager {'None' if e.grad is None else 'a tensor'}"
        if e.grad is not None:
            diff = compare((a.grad,), (e.grad,))
            if diff is not None:
                return f"{name}.grad: {diff.removeprefix('output 0: ')}"
    return None


def run_module(program: ModuleProgram, backend: str = "tpu") -> Outcome:
    """Runs `program` compiled and eagerly, comparing after every call (see the module doc).
    The outcome's `step` attribute is the call it failed at."""
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run_module(program, backend)
    finally:
        torch._dynamo.reset()


def _run_module(program: ModuleProgram, backend: str) -> Outcome:
    ref, mod = build(program), build(program)
    compiled = compile_module(mod, backend)
    x_ref = x_mod = None
    for k, step in enumerate(program.steps):

        def fail(kind, detail, error_type="", k=k):
            return Outcome(kind, f"call {k}: {detail}", error_type, step=k)

        state_ref: dict = {}
        state_mod: dict = {}
        for j, (kind, target, arg) in enumerate(step["mut"]):
            seed = _mix(program.seed, k, j)
            try:
                apply_mutation(ref, state_ref, kind, target, arg, seed)
            except Exception as e:  # noqa: BLE001
                return fail("invalid", f"eager rejects {kind}: {type(e).__name__}: {e}")
            try:
                apply_mutation(mod, state_mod, kind, target, arg, seed)
            except Exception as e:  # noqa: BLE001 - eager accepted it on its copy
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                return fail(
                    "internal", f"{kind}({target}) raised {type(e).__name__}: {msg}", type(e).__name__
                )
        x_ref = _next_input(program, x_ref, step["input"], _mix(program.seed, k, 99))
        x_mod = _next_input(program, x_mod, step["input"], _mix(program.seed, k, 99))
        double = state_ref.get("double", False)
        try:
            expected = _call(ref, x_ref, step, double)
        except Exception as e:  # noqa: BLE001
            return fail("invalid", f"eager raised {type(e).__name__}: {e}")
        try:
            actual = _call(compiled, x_mod, step, double)
        except Exception as e:  # noqa: BLE001 - classify every failure
            got = _classify(e, f"call {k}: ")
            got.step = k
            return got
        diff = compare((actual.detach(),), (expected.detach(),))
        if diff is None and actual.requires_grad != expected.requires_grad:
            diff = f"output requires_grad {actual.requires_grad} vs eager {expected.requires_grad}"
        diff = diff or _compare_state(ref, mod)
        if diff is None and step["grad"] == "backward":
            diff = _compare_grads(ref, mod)
        if diff is None:
            diff = compare((x_mod,), (x_ref,))
            diff = diff and "input " + diff
        if diff is not None:
            return fail("mismatch", diff.removeprefix("output 0: "))
        del expected, actual  # their autograd graphs hold the parameters (swap_tensors checks)
        if double:
            ref.float()
            mod.float()
        ref.zero_grad(set_to_none=True)
        mod.zero_grad(set_to_none=True)
    return Outcome("ok")


def _is_bad(outcome: Outcome) -> bool:
    return outcome.kind in ("mismatch", "internal")


def run_checked(program, runner, **kwargs) -> Outcome:
    """`runner(program)`; a tpuc failure that `backend="aot_eager"` shows too, at the same call and
    of the same kind, is PyTorch's: it becomes "torch" (the aot_eager failure in its detail)."""
    outcome = runner(program, **kwargs)
    if _is_bad(outcome):
        other = runner(program, backend="aot_eager", **kwargs)
        if other.kind == outcome.kind and other.step == outcome.step:
            outcome = Outcome(
                "torch", f"aot_eager too: {other.detail}; tpuc: {outcome.detail}", step=outcome.step
            )
    return outcome


# -- the family: module programs and custom-op programs ---------------------------------------


def generate_stateful(seed: int, only=None):
    """Seed `seed` of the new family: a ModuleProgram (even seeds) or a gen.py program with custom
    ops (odd seeds). `only`: module programs only, with just these mutation kinds."""
    if seed % 2 == 0 or only is not None:
        return generate_module(seed, only)
    from fuzz.customops import generate_custom

    return generate_custom(seed)


def run_stateful(program) -> Outcome:
    if isinstance(program, ModuleProgram):
        return run_checked(program, run_module)
    from fuzz.customops import run_custom

    return run_checked(program, run_custom)


def mode_of(program) -> str:
    return "module" if isinstance(program, ModuleProgram) else "customop"


def program_kinds(program) -> list[str]:
    """The mutation kinds and input policies (module programs) or custom ops and input policies
    (custom-op programs) of `program`."""
    if isinstance(program, ModuleProgram):
        return program.kinds()
    from fuzz.customops import CALL_POLICIES, custom_ops_in

    return sorted(set(custom_ops_in(program))) + [f"input:{p}" for p in CALL_POLICIES[2:]]


def failure_blame(program, outcome: Outcome) -> list[str]:
    """What a failure is blamed on: the mutations and input policy right before the failing call
    (module programs); the custom ops of the program and the failing call's input policy (unless
    plain) for custom-op programs."""
    step = outcome.step
    if isinstance(program, ModuleProgram):
        if step is None or step >= len(program.steps):
            return ["?"]
        return blame(program.steps, step) or ["(no mutation)"]
    from fuzz.customops import CALL_POLICIES, custom_ops_in

    out = sorted(set(custom_ops_in(program)))
    if step is not None and step >= 2:
        out.append(f"input:{CALL_POLICIES[min(step, len(CALL_POLICIES) - 1)]}")
    return out


# -- shrinking and reproducers -----------------------------------------------------------------


def _same_stateful_failure(a: Outcome, b: Outcome, program_a, program_b) -> bool:
    """`a` (a candidate's outcome) is the failure `b`: same kind (and error type), blamed on
    nothing that `b` was not blamed on (so a reproducer of one mutation kind stays one)."""
    if a.kind != b.kind or (a.kind != "mismatch" and a.error_type != b.error_type):
        return False
    return set(failure_blame(program_a, a)) <= set(failure_blame(program_b, b))


def _module_candidates(p: ModuleProgram, failed: int):
    """Smaller variants of `p`, which failed at call `failed`, most promising first."""

    def variant(**changes):
        d = p.to_dict()
        d.update(changes)
        return ModuleProgram.from_dict(json_copy(d))

    steps = json_copy(p.steps)
    if len(steps) > failed + 1:
        yield variant(steps=steps[: failed + 1])
    if any(s["grad"] != "no_grad" for s in steps):  # one grad mode for all calls, then per call
        yield variant(steps=[{**s, "grad": "no_grad"} for s in steps])
    for k in range(len(steps) - 1, -1, -1):
        for j in range(len(steps[k]["mut"]) - 1, -1, -1):
            s = json_copy(steps)
            del s[k]["mut"][j]
            yield variant(steps=s)
    for k in range(1, len(steps) - 1):  # drop an earlier call, its mutations moved to the next
        s = json_copy(steps)
        s[k + 1]["mut"] = s[k]["mut"] + s[k + 1]["mut"]
        del s[k]
        yield variant(steps=s)
    for k in range(len(steps)):
        if steps[k]["input"] != "fresh":
            s = json_copy(steps)
            s[k]["input"] = "fresh" if steps[k]["input"] == "reuse" else "reuse"
            yield variant(steps=s)
        if steps[k]["grad"] != "no_grad":
            s = json_copy(steps)
            s[k]["grad"] = "no_grad"
            yield variant(steps=s)
    for b in range(len(p.blocks) - 1, -1, -1):
        yield variant(blocks=[x for i, x in enumerate(p.blocks) if i != b])
    shape = list(p.input["shape"])
    for d, n in enumerate(shape):
        low = 2 if d == 0 else 1  # batch norm needs two rows in training mode
        for smaller in dict.fromkeys([low, n - 1]):
            if low <= smaller < n:
                yield variant(input={**p.input, "shape": [*shape[:d], smaller, *shape[d + 1 :]]})
    if not p.eval:
        yield variant(eval=True)


def json_copy(x):
    import json

    return json.loads(json.dumps(x))


def shrink_module(program: ModuleProgram, outcome: Outcome, budget: int = 60):
    """Greedily drops calls, mutations, blocks and input dims while the failure persists."""
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for cand in _module_candidates(program, outcome.step or 0):
            if tries >= budget:
                break
            if eager_check(cand) is not None:
                continue
            tries += 1
            got = run_module(cand)
            if _same_stateful_failure(got, outcome, cand, program):
                program, outcome, progress = cand, got, True
                break
    return program, outcome


def shrink_stateful(program, outcome: Outcome, budget: int = 60):
    """The smallest variant of a failing program of the new family that still fails the same way."""
    if isinstance(program, ModuleProgram):
        return shrink_module(program, outcome, budget)
    from fuzz.customops import run_custom
    from fuzz.runner import shrink

    def run_same(candidate):
        got = run_custom(candidate)
        return got if _same_stateful_failure(got, outcome, candidate, program) else Outcome("other")

    return shrink(program, outcome, budget=budget, run_program=run_same)


def reproducer(program, outcome: Outcome, name: str, xfail: str | None = None) -> str:
    """A standalone pytest file for a failing program of the new family."""
    import pprint

    mark = f"@pytest.mark.xfail(strict=True, reason={xfail!r})\n" if xfail else ""
    pytest_import = "import pytest\n\n" if xfail else ""
    if isinstance(program, ModuleProgram):
        what = program.describe()
        load = "ModuleProgram.from_dict(PROGRAM)"
        runner = "run_module"
        imports = "from fuzz.stateful import ModuleProgram, run_module"
    else:
        what = program.source()
        load = "Program.from_dict(PROGRAM)"
        runner = "run_custom"
        imports = "from fuzz.customops import run_custom\nfrom fuzz.gen import Program"
    detail = outcome.detail.replace("\n", " ")
    literal = pprint.pformat(program.to_dict(), width=100, sort_dicts=False)
    return f'''"""Fuzzer regression {name} ({mode_of(program)} program): {outcome.kind}: {detail}

{what}
"""

{pytest_import}{imports}

PROGRAM = {literal}


{mark}def test_{name}():
    outcome = {runner}({load})
    assert outcome.kind in ("ok", "error"), outcome.detail
'''


def save_regression(program, outcome: Outcome, name: str, xfail: str | None = None):
    import re

    from fuzz.runner import REGRESSIONS

    REGRESSIONS.mkdir(exist_ok=True)
    path = REGRESSIONS / f"test_{re.sub(r'[^a-z0-9_]', '_', name.lower())}.py"
    path.write_text(reproducer(program, outcome, name, xfail))
    return path
