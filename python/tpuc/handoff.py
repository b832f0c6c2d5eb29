"""Saved activations handed from a forward graph to its backward in the layout they were made in.

A training step's forward graph returns, after the user's outputs, the tensors its backward
reads (AOTAutograd's saved activations). Convolutions run channels-last (NHWC) inside tpuc, so
returning such a tensor as a row-major NCHW tensor costs a transpose at the end of the forward
and another at the start of the backward (ResNet-50 at batch 8 saves ~780 MB per step this way).
Only tpuc's own backward reads these tensors, so nothing needs them row-major:

* forward: the saved outputs may come back in their physical layout (`Graph::free_layout_outputs`
  in Rust; lowering says which did, `Executable.output_perms`); torch gets a permuted view of the
  NHWC buffer, i.e. an NCHW tensor with channels-last strides, the same values;
* backward: each placeholder the forward returned that way is declared NHWC, followed by the
  permute back to NCHW (which lowering keeps as a layout transpose: convolutions and the ops
  that follow layouts read the NHWC data as it is), and the backward's callable is given the
  NHWC view of the tensor it receives (`input_views.PermutedArgs`: no copy when the strides are
  the forward's).

Exact whatever arrives: a saved tensor with other strides (a saved-tensor hook that copied it)
is made contiguous in its NHWC view by the general call path, as any non-contiguous input.
`TPUC_HOST_KERNELS=-handoff` turns it off (read per compiled graph); `tpuc.stats()`
counts the activations handed over (`saved_channels_last`).
"""

from __future__ import annotations

import torch
import torch.fx

from . import counters, env, input_views

# NHWC of an NCHW tensor, and back.
NHWC_OF_NCHW = (0, 2, 3, 1)
NCHW_OF_NHWC = (0, 3, 1, 2)


def enabled() -> bool:
    return env.host_kernel("handoff")


class Handoff:
    """One Dynamo graph's forward/backward pair: which saved activations the forward returned
    channels-last, by the FX name the backward's placeholder shares."""

    def __init__(self):
        self.perms: dict[str, tuple] = {}
        # The forward's outputs that are its inputs or views of them (input_views.py).
        self.views: set[str] = set()

    @staticmethod
    def saved_positions(gm: torch.fx.GraphModule) -> list[int]:
        """The output positions of forward graph `gm` that hold saved activations only tpuc's
        backward reads: after AOTAutograd's user outputs (its forward metadata), 4-D floating
        tensors. None when the metadata is missing or the graph threads effect tokens."""
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is None or getattr(meta, "tokens", None):
            return []
        outs = input_views.graph_outputs(gm)
        user = {id(o) for o in outs[: meta.num_forward]}
        positions = []
        for i in range(meta.num_forward, len(outs)):
            o = outs[i]
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if (
                isinstance(val, torch.Tensor)
                and val.ndim == 4
                and val.dtype.is_floating_point
                and id(o) not in user
            ):
                positions.append(i)
        return positions

    def forward_compiled(self, names: dict[int, str], perms: dict[int, list]) -> None:
        """Records the outputs the forward returned channels-last: `perms` maps their positions
        to the permutation lowering reported, `names` the positions to FX names."""
        for i, perm in perms.items():
            if tuple(perm) == NCHW_OF_NHWC and i in names:
                self.perms[names[i]] = NCHW_OF_NHWC
        counters.add(saved_channels_last=len(self.perms))

    def rewrite_backward(self, gm: torch.fx.GraphModule) -> dict[int, tuple]:
        """Declares each placeholder of backward graph `gm` that the forward returned
        channels-last as NHWC, read through a permute to NCHW. Returns {position: the order to
        permute their args by} (for `input_views.PermutedArgs`)."""
        positions = []
        if not self.perms:
            return {}
        for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            val = ph.meta.get("val")
            if self.perms.get(ph.name) != NCHW_OF_NHWC or not isinstance(val, torch.Tensor) or val.ndim != 4:
                continue
            input_views.declare_storage_order(gm, ph, NHWC_OF_NCHW)
            positions.append(i)
        if positions:
            gm.graph.lint()
            gm.recompile()
        return {i: NHWC_OF_NCHW for i in positions}
