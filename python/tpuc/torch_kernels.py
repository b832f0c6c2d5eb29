"""Ops that tpuc hands to PyTorch's own CPU kernel on the CPU plugin, as Inductor does (it calls
ATen's flash attention as an extern kernel): where that kernel beats what XLA's CPU backend makes
of tpuc's lowering by more than the cost of splitting the graph around it.

Attention over many keys is the one such op: PyTorch's CPU flash attention keeps each block of
scores in cache and never writes them out, where XLA's CPU backend runs the lowering's query
blocks pass by pass over memory (scores, max, exponentials, sum, product). UNet's 4096-token
attention (8 heads of 8): 53 ms in PyTorch, 134 through XLA; the whole UNet step 307 ms instead
of 640. Only on the CPU plugin, whose buffers are the tensors' own memory (nothing is copied
between the partitions); `TPUC_HOST_KERNELS=-torch` keeps everything in XLA.

The graph is split with the fallback partitioner: the attention runs in PyTorch between the
compiled partitions before and after it. It is not a fallback: nothing is warned or counted in
`fallback_ops`; `tpuc.stats()["torch_kernels"]` counts these nodes per op.
"""

from __future__ import annotations

import torch

from . import env

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"

# Scores (batch x heads x queries x keys) above which attention runs in PyTorch: where the
# lowering starts to split its queries into blocks (`BLOCK_SCORES` in attention.rs), because the
# scores no longer fit the cache. Below it XLA's fused attention is as fast and needs no split.
MIN_SCORES = 1 << 22


def enabled() -> bool:
    """Whether `TPUC_HOST_KERNELS` allows handing ops to PyTorch (path `torch`, on by default)."""
    return env.host_kernel("torch")


def nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of `gm` that PyTorch's kernel runs faster (none unless `enabled()`); the
    caller hands them over only on the CPU plugin, whose buffers are host memory."""
    if not enabled():
        return []
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target) == ATTENTION and _scores(n) > MIN_SCORES
    ]


def _scores(n: torch.fx.Node) -> int:
    """The size of an attention node's score matrix; 0 where a size is symbolic (such graphs
    serve many shapes and stay whole)."""
    q, k = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in n.args[:2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        return 0
    sizes = [*q.shape[:3], k.shape[2]]
    if not all(isinstance(s, int) for s in sizes):
        return 0
    batch, heads, queries, keys = sizes
    return batch * heads * queries * keys
