"""Bounded dynamism at run time: declared maxima, bucket choice, padding inputs and slicing
outputs around the executable that the bucketing pass (Rust, `tpuc_passes::bucket`) built.

A dim marked with `torch._dynamo.mark_dynamic(x, dim, max=M)` is padded up to the smallest
bucket that fits (buckets: `options["buckets"]`, "pow2" by default, always ending at M); one
executable per bucket serves every real size in it, and its results are exact for the real sizes.
"""

from __future__ import annotations

import re
import threading

import torch

_SOURCE = re.compile(r"^L\['(\w+)'\](.*)\.size\(\)\[(\d+)\]$")
_LARGE = 2**62


def describe(source: str) -> str:
    """`L['ids'].size()[1]` -> "input `ids` dim 1"; `L['args'][0].size()[0]` -> "input
    `args[0]` dim 0"."""
    m = _SOURCE.match(source)
    return f"input `{m.group(1)}{m.group(2)}` dim {m.group(3)}" if m else source


def user_declared(gm: torch.fx.GraphModule) -> dict[str, int]:
    """{size source (`L['x'].size()[0]`): maximum} for every dim the user bounded with
    `torch._dynamo.mark_dynamic(x, dim, max=M)` on a tensor this trace read. Only these are
    declared: a bound the trace inferred (a guard such as torchvision's `boxes.numel() > 4000`
    test, a data-dependent size's value range) holds for this trace alone, and a larger size
    retraces or compiles per shape."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        source = getattr(getattr(arg, "source", None), "name", None)
        try:
            example = arg.example if arg is not None else None
        except Exception:  # erased, or not a tensor argument
            continue
        for dim_range in getattr(example, "_dynamo_dynamic_range", ()) if source else ():
            if dim_range.max is not None:
                out[f"{source}.size()[{dim_range.dim}]"] = int(dim_range.max)
    return out


def declared_maxima(example_inputs, declared: dict[str, int]) -> dict[str, tuple[int, str]]:
    """{symbol: (maximum, source)} for every size symbol of this trace that is a dim the user
    declared a maximum for (`declared`: `user_declared`); the maximum is the trace's upper bound
    for it (the declared one, or lower where the trace's guards narrowed it)."""
    fake = torch._guards.detect_fake_mode(example_inputs)
    env = getattr(fake, "shape_env", None)
    if env is None or not declared:
        return {}
    out = {}
    for sym, rng in env.var_to_range.items():
        try:
            upper = int(rng.upper)
            lower = int(rng.lower)
        except Exception:  # int_oo: no finite bound; -int_oo: an integer that is not a size
            # (an unbacked value such as a clamp of `.item()` only bounded above: gemma3's
            # sliding-window masks under a static cache), never a marked dim
            continue
        if upper >= _LARGE or lower >= upper:
            # A range of one value is the trace pinning the size (a Linear's input features
            # equal to its weight's), not a declared maximum.
            continue
        names = [s.name for s in env.var_to_sources.get(sym) or []]
        source = next((name for name in names if name in declared), None)
        if source is not None:
            out[str(sym)] = (min(upper, declared[source]), source)
    return out


def bucket_sizes(buckets, maximum: int) -> list[int]:
    """The bucket sizes for a dim with declared `maximum`: the buckets below it, and the
    maximum itself so that every size up to it has a bucket; "pow2" = 2, 4, 8, ... ."""
    if buckets == "pow2":
        sizes, b = [], 2
        while b < maximum:
            sizes.append(b)
            b *= 2
    else:
        sizes = [b for b in buckets if b < maximum]
    return sorted(set(sizes + [maximum]))


def choose(size: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= size)


def with_sizes(maxima: dict | None, buckets) -> dict:
    """{symbol: (maximum, source, bucket sizes)} for `declared_maxima`'s {symbol: (maximum,
    source)} and the `buckets` option."""
    return {sym: (mx, src, bucket_sizes(buckets, mx)) for sym, (mx, src) in (maxima or {}).items()}


def bucket_of(maxima: dict, bindings: dict) -> dict:
    """The bucket sizes for real `bindings` (`maxima`: `with_sizes`); raises ValueError above a
    declared maximum."""
    chosen = {}
    for sym, (mx, src, sizes) in maxima.items():
        if sym not in bindings:
            continue
        n = bindings[sym]
        if n > mx:
            raise ValueError(
                f"tpuc: {describe(src)} has size {n}, above its declared maximum {mx} "
                "(torch._dynamo.mark_dynamic(..., max=...))"
            )
        chosen[sym] = choose(n, sizes)
    return chosen


def key(chosen: dict, bindings: dict) -> tuple:
    """Identifies one bucket's executable: the bucket sizes and every other symbol's value."""
    others = tuple(sorted((k, v) for k, v in bindings.items() if k not in chosen))
    return tuple(sorted(chosen.items())), others


def bucket_graph(graph, chosen: dict, bindings: dict):
    """(key, bucketed graph) of the FxGraph `graph` for the bucket sizes `chosen` (other
    symbols at their values in `bindings`); raises TpucError when the bucketing pass cannot
    make this graph exact."""
    from . import _native

    sizes = {**bindings, **chosen}
    bg = _native.bucket_graph(graph, [s for s, b in chosen.items() if b > 1], sizes)
    return key(chosen, bindings), bg


# Declared maxima per Dynamo frame: when a size above one comes, Dynamo's guard fails and it
# traces again; the new trace is where we can tell the user.
_frame_maxima: dict[int, dict[str, int]] = {}
_frame_lock = threading.Lock()


def _hint(size) -> int | None:
    if isinstance(size, int):
        return size
    try:
        return int(size.node.hint)
    except Exception:
        return None


def check_declared(gm: torch.fx.GraphModule, example_inputs, declared: dict[str, int]) -> None:
    """Raises ValueError when an input of this trace is larger than the maximum the user
    declared for it on an earlier trace of the same frame; then records this trace's
    declarations (`declared`: `user_declared`)."""
    cid = torch._guards.CompileContext.current_compile_id()
    frame = getattr(cid, "frame_id", None)
    if frame is None:
        return
    with _frame_lock:
        if not getattr(cid, "frame_compile_id", 0):
            # The frame's first compile (frame ids restart after torch._dynamo.reset()).
            _frame_maxima.pop(frame, None)
        earlier = dict(_frame_maxima.get(frame, {}))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs, strict=False):
        source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        if source is None or not isinstance(ex, torch.Tensor):
            continue
        for d, size in enumerate(ex.shape):
            key = f"{source}.size()[{d}]"
            n = _hint(size)
            if key in earlier and n is not None and n > earlier[key]:
                raise ValueError(
                    f"tpuc: {describe(key)} has size {n}, above its declared maximum {earlier[key]} "
                    "(torch._dynamo.mark_dynamic(..., max=...))"
                )
    with _frame_lock:
        _frame_maxima.setdefault(frame, {}).update(declared)


def pad(t: torch.Tensor, sizes) -> torch.Tensor:
    """`t` (real shape) padded with zeros at the end of each padded atom: `sizes` is, per dim,
    `[(padded, real), ...]` for its atoms (outer to inner)."""
    padded = [p for dim in sizes for p, _ in dim]
    real = [r for dim in sizes for _, r in dim]
    z = t.new_zeros(padded)
    z[tuple(slice(0, r) for r in real)] = t.reshape(real)
    return z.view([_prod(p for p, _ in dim) for dim in sizes])


def unpad(t: torch.Tensor, sizes) -> torch.Tensor:
    """The real elements of a padded output, in its real shape."""
    padded = [p for dim in sizes for p, _ in dim]
    real = [r for dim in sizes for _, r in dim]
    shape = [_prod(r for _, r in dim) for dim in sizes]
    out = t.view(padded)[tuple(slice(0, r) for r in real)].reshape(shape)
    if out._base is not None:
        # A view of the padded buffer (padding only in the outermost dim). Return a tensor of
        # its own over the same memory: AOTAutograd rebuilds an output that aliases an input
        # from the output's `_base`, and the padded buffer is larger than that input.
        own = out.new_empty(0)
        own.set_(out.untyped_storage(), out.storage_offset(), out.size(), out.stride())
        out = own
    return out


def needs_padding(sizes) -> bool:
    return any(p != r for dim in sizes for p, r in dim)


def _prod(it) -> int:
    n = 1
    for x in it:
        n *= x
    return n


class Plan:
    """Everything one real shape needs to run on its bucket's executable, computed once."""

    __slots__ = ("exe", "out_types", "pads", "scalars", "scalar_arrays", "results", "unpads", "symfloats")

    def __init__(self, exe, out_types, pads, scalars, results, unpads, symfloats):
        self.exe = exe
        self.out_types = out_types
        self.pads = pads  # per graph input: None or the atoms to pad it to
        self.scalars = scalars  # 0-d int64 tensors, kept alive while the plan is
        self.scalar_arrays = [(s.data_ptr(), s.nbytes, "int64", []) for s in scalars]
        self.results = results  # per graph output: ("tensor", k) | ("input", i) | ("value", v)
        self.unpads = unpads  # per executable output: None or the atoms to slice it by
        self.symfloats = symfloats  # size-derived float inputs (0-d float64 tensors)
