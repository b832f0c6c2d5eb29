"""FX graph -> the JSON that the Rust frontend imports (`frontend_fx/src/wire.rs`).

The only place that knows both torch.fx and the wire format. `get_attr` nodes (lifted constants)
become extra inputs after the placeholders; `attr_inputs` lists their targets so the runtime can
pass them.
"""

from __future__ import annotations

import json
import math
import operator

import torch
import torch.fx

from . import _native

#: Names computed once per dtype and per op target: `str()` of an OpOverload formats it anew
#: each call, and an export asks for every node's (keys are interned torch objects, few of them).
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_TARGET_NAMES: dict[object, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _target_name(target) -> str:
    name = _TARGET_NAMES.get(target)
    if name is None:
        name = _TARGET_NAMES[target] = (
            "<built-in function getitem>" if target is operator.getitem else str(target)
        )
    return name


def _sym(value) -> str | int:
    """A size as the wire format wants it: an int, or the ShapeEnv expression text."""
    if isinstance(value, int):
        return value
    expr = value.node.expr
    if getattr(expr, "is_number", False):
        return int(expr)
    return str(expr)


def _meta(val, node: torch.fx.Node):
    if val is None:
        return None
    if isinstance(val, torch.Tensor):
        return {
            "tensor": {
                "shape": [d if type(d) is int else _sym(d) for d in val.shape],
                "dtype": dtype_name(val.dtype),
            }
        }
    if isinstance(val, torch.SymInt):
        s = _sym(val)
        return {"int": s} if isinstance(s, int) else {"symint": s}
    if isinstance(val, bool):
        return {"bool": val}
    if isinstance(val, int):
        return {"int": val}
    if isinstance(val, float):
        return {"float": val}
    if isinstance(val, torch.SymFloat):
        expr = val.node.expr
        return {"float": float(expr)} if getattr(expr, "is_number", False) else None
    if isinstance(val, list | tuple):
        return {"tuple": [_meta(v, node) for v in val]}
    return None


_PLAIN = (int, bool, str, type(None))


def _arg(a, node: torch.fx.Node):
    if type(a) in _PLAIN:  # the common literals, exactly (subclasses take the checks below)
        return a
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    if a is None or isinstance(a, bool | str):
        return a
    if isinstance(a, int):
        return a
    if isinstance(a, float):
        if math.isfinite(a):
            return a
        return {"float": "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")}
    if isinstance(a, list | tuple):
        return [_arg(x, node) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout | torch.memory_format):
        return {"other": str(a)}
    if isinstance(a, torch.SymInt):
        s = _sym(a)
        if isinstance(s, int):
            return s
    raise _native.GraphImportError(
        f"node `{node.name}` (op `{node.target}`): argument {a!r} of type {type(a).__name__} "
        "cannot be passed to tpuc"
    )


def _is_symfloat(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymFloat)


def _target(node: torch.fx.Node) -> str:
    target = node.target
    # A size-derived float becomes a 0-d tensor input: use the op's Tensor overload.
    if (
        isinstance(target, torch._ops.OpOverload)
        and target._overloadname == "Scalar"
        and any(_is_symfloat(a) for a in node.args)
        and hasattr(target.overloadpacket, "Tensor")
    ):
        target = target.overloadpacket.Tensor
    return _target_name(target)


def symfloat_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes computing a float from sizes (`n / (n - 1)` in batch norm's running variance):
    they become 0-d float64 inputs whose values the runtime computes from the real sizes."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.SymFloat)
        and not getattr(n.meta["val"].node.expr, "is_number", False)
    ]


#: Ops drawing random numbers: each gets the graph's seed input and its own stream index.
RANDOM_OPS = frozenset({"aten.native_dropout.default"})
SEED_INPUT = "tpuc_rng_seed"


def uses_rng(gm: torch.fx.GraphModule) -> bool:
    """Whether the exported graph takes a seed input (last, after the size-derived floats)."""
    return any(n.op == "call_function" and _target_name(n.target) in RANDOM_OPS for n in gm.graph.nodes)


def export(gm: torch.fx.GraphModule) -> tuple[str, list[str]]:
    """Returns (wire JSON, targets of get_attr nodes in input order)."""
    inputs, attrs, ops = [], [], []
    attr_inputs = []
    symfloats = set(symfloat_nodes(gm))
    streams = 0
    for n in gm.graph.nodes:
        if n in symfloats:
            continue
        if n.op == "placeholder":
            inputs.append(
                {"name": n.name, "op": "placeholder", "target": n.name, "val": _meta(n.meta.get("val"), n)}
            )
        elif n.op == "get_attr":
            val = getattr(gm, n.target)
            if not isinstance(val, torch.Tensor):
                raise _native.GraphImportError(f"node `{n.name}`: get_attr of a {type(val).__name__}")
            attr_inputs.append(n.target)
            attrs.append({"name": n.name, "op": "placeholder", "target": n.target, "val": _meta(val, n)})
        elif n.op in ("call_function", "output"):
            args = [_arg(a, n) for a in n.args]
            target = _target(n)
            if n.op == "call_function" and target in RANDOM_OPS:
                # Positional args padded to the schema's length, then the seed and the stream.
                schema_len = len(n.target._schema.arguments)
                args += [
                    _arg(n.kwargs[a.name], n) if a.name in n.kwargs else None
                    for a in n.target._schema.arguments[len(args) :]
                ]
                args = args[:schema_len] + [{"node": SEED_INPUT}, streams]
                streams += 1
            ops.append(
                {
                    "name": n.name,
                    "op": n.op,
                    "target": target,
                    "args": args,
                    "kwargs": {k: _arg(v, n) for k, v in n.kwargs.items()},
                    "val": _meta(n.meta.get("val"), n),
                }
            )
        else:
            raise _native.GraphImportError(
                f"node `{n.name}`: {n.op} `{n.target}` (tpuc imports functional ATen graphs from AOTAutograd)"
            )
    # Lifted constants become inputs after the placeholders, then size-derived floats: the runtime
    # appends them to the args.
    floats = [
        {
            "name": n.name,
            "op": "placeholder",
            "target": n.name,
            "val": {"tensor": {"shape": [], "dtype": "float64"}},
        }
        for n in gm.graph.nodes
        if n in symfloats
    ]
    if streams:
        floats.append(
            {
                "name": SEED_INPUT,
                "op": "placeholder",
                "target": SEED_INPUT,
                "val": {"tensor": {"shape": [2], "dtype": "int64"}},
            }
        )
    return _JSON.encode({"nodes": inputs + attrs + floats + ops}), attr_inputs


# Compact and without the cycle check (the tree is built just above): a quarter less time.
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)
