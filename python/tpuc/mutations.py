"""Input mutations kept in the graph: with `keep_inference_input_mutations`, AOTAutograd ends an
inference graph that writes into its inputs (a static KV cache's `index_copy_`, a step counter's
`+= 1`, a buffer's running statistics) with `copy_(input, new_value)` nodes, and leaves the
write to the compiled graph instead of copying every new value back in its runtime wrapper.

`split` takes those nodes out (XLA has no in-place write into a caller's tensor) and returns
what `WithWrites` does after each call instead:
- a *row write* (the new value is the input with one index along one dim replaced, the form of a
  KV cache update at a decode step: `index_put(x, [None, .., i], row)`) returns just the row and
  the index, and `_native.write_rows` writes that row into the input's own memory: a decode step
  of a Llama-style decoder with 16 cache tensors no longer copies 16 whole caches;
- any other write returns the new value, copied into the input (`copy_`), which is what
  AOTAutograd's wrapper did.

The graph is then functional again, and an inference graph whose only side effects were these
writes skips AOTAutograd's runtime wrapper (backend._plain_inference), so `WithWrites` also bumps
the written tensors' versions, as that wrapper would."""

from __future__ import annotations

import torch

from . import _native

aten = torch.ops.aten


class Writes:
    """The writes of one graph. `n_outputs`: the graph's own outputs (the new values follow);
    `full`: (input position, output position) pairs; `rows`: per row write (input position,
    output position of the row, of the index, dim, the input's shape and dtype)."""

    def __init__(self, n_outputs: int):
        self.n_outputs = n_outputs
        self.full: list[tuple[int, int]] = []
        self.rows: list[tuple[int, int, int, int, tuple, torch.dtype]] = []


def split(gm: torch.fx.GraphModule, rows_allowed: bool = True) -> Writes | None:
    """Replaces `gm`'s `copy_` into its inputs by outputs (see the module docs); None where it has
    none. `rows_allowed`: whether row writes may be taken (static shapes only: not for bucketed
    graphs, whose inputs are padded)."""
    copies = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is aten.copy_.default and n.args[0].op == "placeholder"
    ]
    if not copies or not all(_same_type(c.args[0], c.args[1]) for c in copies if c.users):
        return None
    for c in copies:
        # An output that is the written input (AOTAutograd regenerates it from the input, which
        # holds the new value by then): the new value itself.
        c.replace_all_uses_with(c.args[1])
    position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out = gm.graph.output_node()
    outs = list(out.args[0])
    writes = Writes(len(outs))
    added: dict[torch.fx.Node, int] = {}  # one output per node (a decoder's layers share the index)

    def output(node: torch.fx.Node) -> int:
        if node not in added:
            added[node] = len(outs)
            outs.append(node)
        return added[node]

    for c in copies:
        dst, src = c.args[0], c.args[1]
        row = _row_write(dst, src, c) if rows_allowed else None
        if row is not None:
            index, values, dim = row
            writes.rows.append(
                (
                    position[dst],
                    output(values),
                    output(index),
                    dim,
                    tuple(dst.meta["val"].shape),
                    dst.meta["val"].dtype,
                )
            )
        else:
            writes.full.append((position[dst], output(src)))
        gm.graph.erase_node(c)
    out.args = (type(out.args[0])(outs),)
    gm.recompile()
    # For the compile (compiled_graph.py, targets.py): the new value's output may reuse the
    # input's buffer (input-output aliasing, `written_inputs`).
    gm.meta[WRITTEN_INPUTS] = list(writes.full)
    return writes


# gm.meta key: the (input position, output position) pairs of a graph's full writes, as the
# graph's outputs stand after the preparation steps (input_views renumbers them).
WRITTEN_INPUTS = "tpuc_written_inputs"


def record_aot_writes(gm: torch.fx.GraphModule) -> None:
    """Records on the forward (or inference) graph `gm` the writes AOTAutograd's runtime wrapper
    does after it: without `keep_inference_input_mutations` (a whole training step, whose
    parameters require grad), the graph returns the new value of each written input first, in
    input order, and the wrapper copies it in. Read from AOTAutograd's metadata of the graph
    being compiled; nothing where it does not describe `gm`'s placeholders one to one (effect
    tokens, tensor subclasses, merged aliased inputs) or a pair differs in shape or dtype."""
    from torch._functorch._aot_autograd.schemas import MutationType, PlainTensorMeta

    ctx = torch._guards.TracingContext.try_get()
    m = getattr(ctx, "fw_metadata", None)
    try:
        if m is None or not m.num_mutated_inp_runtime_indices or m.tokens:
            return
        if not all(type(s) is PlainTensorMeta or isinstance(s, int) for s in m.subclass_inp_meta):
            return
        infos = m.input_info
        indices = list(m.mutated_inp_runtime_indices)
    except AttributeError:  # another torch's metadata
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = gm.graph.output_node().args[0]
    if len(placeholders) < len(infos) or not isinstance(outs, list | tuple) or len(outs) < len(indices):
        return
    pairs = []
    for k, i in enumerate(indices):
        info = infos[i]
        if (
            info.mutation_type is MutationType.MUTATED_OUT_GRAPH
            and info.mutates_data
            and not info.mutates_metadata
        ):
            if _same_type(placeholders[i], outs[k]):
                pairs.append((i, k))
    if pairs:
        gm.meta[WRITTEN_INPUTS] = pairs


def written_inputs(gm: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """The (input position, output position) pairs `split` or `record_aot_writes` recorded on
    `gm` (none where it writes nothing)."""
    return list(getattr(gm, "meta", {}).get(WRITTEN_INPUTS, ()))


def _same_type(dst: torch.fx.Node, src) -> bool:
    """Whether `src` is a node of `dst`'s shape and dtype (so that `copy_(dst, src)` is `src`)."""
    a, b = dst.meta.get("val"), getattr(src, "meta", {}).get("val")
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def _row_write(dst: torch.fx.Node, src, copy: torch.fx.Node):
    """(index node, row node, dim) where `src` is `dst` with one index along one dim replaced by
    a row of its own dtype (`index_put(dst, [None, .., i], row)`, `i` one integer), nothing else
    reads `dst`, and every shape is static and dense; else None."""
    if not (
        isinstance(src, torch.fx.Node)
        and src.op == "call_function"
        and src.target in (aten.index_put.default, aten._unsafe_index_put.default)
        and src.args[0] is dst
        and not (len(src.args) > 3 and src.args[3])
        and set(dst.users) == {src, copy}
    ):
        return None
    indices, values = src.args[1], src.args[2]
    live = [d for d, i in enumerate(indices) if i is not None]
    if len(live) != 1 or not isinstance(values, torch.fx.Node):
        return None
    dim = live[0]
    index = indices[dim]
    x, v, i = dst.meta.get("val"), values.meta.get("val"), getattr(index, "meta", {}).get("val")
    if not all(isinstance(t, torch.Tensor) for t in (x, v, i)):
        return None
    shapes = (*x.shape, *v.shape, *i.shape)
    if not all(isinstance(s, int) for s in shapes):
        return None
    want = list(x.shape)
    want[dim] = 1
    if (
        list(v.shape) != want
        or v.dtype != x.dtype
        or i.dtype not in (torch.int64, torch.int32)
        or i.numel() != 1
        or not x.is_contiguous()
    ):
        return None
    return index, values, dim


class WithWrites:
    """`inner` (a boxed compiled graph of `split`'s form), then the writes; returns the graph's
    own outputs."""

    _boxed_call = True

    def __init__(self, inner, writes: Writes):
        self.inner = inner
        self.writes = writes

    def __call__(self, args):
        w = self.writes
        # Before the call: a boxed callee may clear `args`.
        full = [(args[i], k) for i, k in w.full]
        rows = [(args[i], *rest) for i, *rest in w.rows]
        outs = self.inner(args)
        if rows:  # first: an index out of range raises before anything is written
            _write_rows(rows, outs)
        for dst, k in full:
            dst.copy_(outs[k])
        return outs[: w.n_outputs]


def _write_rows(rows: list, outs: list) -> None:
    plain, written = [], []
    for dst, v, x, dim, shape, dtype in rows:
        values, index = outs[v], outs[x]
        if (
            dst.dtype == dtype
            and dst.shape == shape
            and dst.is_contiguous()
            and not dst.is_neg()
            and not dst.is_conj()
            and values.is_contiguous()
        ):
            plain.append(
                (
                    dst.data_ptr(),
                    values.data_ptr(),
                    index.data_ptr(),
                    index.dtype == torch.int64,
                    shape,
                    dim,
                    dst.element_size(),
                )
            )
            written.append(dst)
        else:  # a layout the row copy does not describe: PyTorch's own write, same semantics
            dst.index_put_((None,) * dim + (index.reshape(-1),), values)
    if plain:
        _native.write_rows(plain)
        torch.autograd.graph.increment_version(written)
