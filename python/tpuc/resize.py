"""Bilinear resizing (`F.interpolate(mode="bilinear")`) with eager's interpolation weights.

PyTorch decomposes `upsample_bilinear2d` while tracing, so tpuc receives the source coordinate
`scale * (i + 0.5) - 0.5` as float multiply and subtract ops that XLA compiles its own way (its
CPU code generation fuses them into one multiply-add), where eager's C++ kernel rounds them as
its compiler built it (on this host: twice for some sizes, fused for others). One unit of a
coordinate near 200 is 1.5e-5 in a weight: the resized image was 1e-5 (relative) off eager's, a
hundred times aot_eager's difference, and detection models, which resize their input first,
turned that into different detections through near-tied scores (docs/detection.md).

Where the Dynamo graph's shapes are static, each such call is replaced here, before AOTAutograd,
by gathers and weights read from eager's own kernel at compile time (`_taps`: one-hot rows
resized along each dim give every output's two input positions and weights exactly). They reach
the traced graph as constants (`torch.tensor` of the lists: lifted constants, which tpuc passes
as inputs), and the sum is eager's order (width first, then height): equal to eager's to a unit
in the last place.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx
import torch.nn.functional as F

_SIGNATURE = inspect.signature(F.interpolate)
_DTYPES = (torch.float32, torch.float64)
# The largest probe (input size x output size of one dim) read from eager: 4M elements, 16 MB.
MAX_PROBE = 1 << 22


def _taps(size_in: int, size_out: int, align_corners: bool, scale: float | None, dtype):
    """(first indices, second indices, first weights, second weights) per output position of one
    dim: eager's own, read from its kernel. How it rounds `scale * (i + 0.5) - 0.5` depends on
    how the C++ compiler built the kernel (a fused multiply-add for some sizes and not others, on
    this host), so the weights are taken from it: one-hot rows resized along that dim give each
    output's weights exactly (the other dim is 1 -> 1, weights 1 and 0). None where an output
    reads other than one or two inputs."""
    probe = torch.eye(size_in, dtype=dtype).reshape(size_in, 1, 1, size_in)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        out = torch.ops.aten.upsample_bilinear2d.default(probe, [1, size_out], align_corners, None, scale)
    weights = out.reshape(size_in, size_out).t()  # (output, input)
    i0, i1, w0, w1 = [], [], [], []
    for row in weights:
        cols = row.nonzero().flatten().tolist()
        if len(cols) == 1:
            cols = cols * 2
        if len(cols) != 2:
            return None
        i0.append(cols[0])
        i1.append(cols[1])
        w0.append(row[cols[0]].item())
        w1.append(row[cols[1]].item() if cols[1] != cols[0] else 0.0)
    return i0, i1, w0, w1


def _bilinear(x, height, width):
    """Eager's bilinear sum with the taps given ((first index, second index, first weight,
    second weight) lists per dim): each row by width, then the two rows by height. The taps
    become constants of the traced graph."""

    def constants(taps, weight_shape):
        i0, i1, w0, w1 = taps
        index = [torch.tensor(i, dtype=torch.int64, device=x.device) for i in (i0, i1)]
        weight = [torch.tensor(w, dtype=x.dtype, device=x.device).reshape(weight_shape) for w in (w0, w1)]
        return (*index, *weight)

    h0, h1, hw0, hw1 = constants(height, (-1, 1))
    w0, w1, ww0, ww1 = constants(width, (-1,))

    def row(r):
        return r.index_select(3, w0) * ww0 + r.index_select(3, w1) * ww1

    return row(x.index_select(2, h0)) * hw0 + row(x.index_select(2, h1)) * hw1


def _static_sizes(shape) -> list[int] | None:
    sizes = list(shape)
    return sizes if all(type(s) is int for s in sizes) else None


def _scales(bound, ndim: int) -> list[float | None] | None:
    """The scales eager's kernel uses (None: in/out sizes), or None where this cannot say."""
    scale_factor = bound.arguments.get("scale_factor")
    if scale_factor is None or bound.arguments.get("recompute_scale_factor"):
        return [None] * ndim
    factors = list(scale_factor) if isinstance(scale_factor, list | tuple) else [scale_factor] * ndim
    if not all(type(f) in (int, float) for f in factors):
        return None
    return [float(f) for f in factors]


def static_bilinear(gm: torch.fx.GraphModule) -> int:
    """Replaces `gm`'s 4-d float32/float64 `F.interpolate(mode="bilinear")` calls of static
    shape (no antialiasing) with gathers and weights computed now; returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.interpolate:
            continue
        try:
            bound = _SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        args = bound.arguments
        x = args["input"]
        if args["mode"] != "bilinear" or args["antialias"] or not isinstance(x, torch.fx.Node):
            continue
        inp, out = x.meta.get("example_value"), node.meta.get("example_value")
        if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
            continue
        in_sizes, out_sizes = _static_sizes(inp.shape), _static_sizes(out.shape)
        scales = _scales(bound, 2)
        if inp.dtype not in _DTYPES or inp.dim() != 4 or None in (in_sizes, out_sizes, scales):
            continue
        if any(in_sizes[d] * out_sizes[d] > MAX_PROBE for d in (2, 3)):
            continue
        align = bool(args["align_corners"])
        height, width = (_taps(in_sizes[d], out_sizes[d], align, scales[d - 2], inp.dtype) for d in (2, 3))
        if height is None or width is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_bilinear, (x, height, width))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done
