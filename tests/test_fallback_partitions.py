"""Graphs split around ops tpuc does not lower (library custom ops, effectful ops, ops whose
output sizes depend on values) give eager's results: the custom ops here read tensor values on
the host, mutate an argument, or are ordered side effects, and they sit between tpuc partitions."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

import tpuc

# Every test here runs again under TPUC_DEBUG=discrete_device: partitions hand their results to each
# other and to PyTorch's ops through the device.
pytestmark = pytest.mark.discrete_device


@torch.library.custom_op("tpuc_fallback::scale_groups", mutates_args=())
def scale_groups(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row groups ending at `offs` (read on the host, as grouped-matmul fallbacks do), group k
    scaled by k + 1."""
    out = x.clone()
    start = 0
    for k, end in enumerate(offs.tolist()):
        out[start:end] *= k + 1
        start = end
    return out


@scale_groups.register_fake
def _(x, offs):
    return torch.empty_like(x)


@torch.library.custom_op("tpuc_fallback::accumulate", mutates_args=("acc",))
def accumulate(x: torch.Tensor, acc: torch.Tensor) -> None:
    acc.add_(x.sum(0))


@accumulate.register_fake
def _(x, acc):
    return None


LOG: list[float] = []


@torch.library.custom_op("tpuc_fallback::record", mutates_args=())
def record(x: torch.Tensor) -> torch.Tensor:
    LOG.append(float(x.sum()))
    return x.clone()


@record.register_fake
def _(x):
    return torch.empty_like(x)


_register_effectful_op(torch.ops.tpuc_fallback.record.default, _EffectType.ORDERED)


def _routed(x, w, acc):
    # A router in the style of MoE layers: stable sort by expert, counts, offsets, host-read groups.
    h = torch.tanh(x @ w)
    expert = (h[:, 0] > 0).long() + (h[:, 1] > 0).long()
    order = torch.argsort(expert, stable=True)
    offs = torch.cumsum(torch.bincount(expert, minlength=3), 0)
    y = scale_groups(h[order], offs)
    out = torch.empty_like(y).index_copy_(0, order, y)  # back to token order
    z = record(out @ w)
    accumulate(z, acc)
    picked = torch.masked_select(z, z > 0)  # data-dependent size
    return z.relu() + acc, picked.sum() + z.mean()


def test_custom_ops_between_partitions_match_eager():
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 8)
    acc_eager, acc_tpu = torch.zeros(8), torch.zeros(8)
    compiled = torch.compile(_routed, backend="tpu")
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            LOG.clear()
            expected = _routed(x, w, acc_eager)
            eager_log = list(LOG)
            LOG.clear()
            actual = compiled(x, w, acc_tpu)
            for a, e in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(acc_tpu, acc_eager, rtol=1e-5, atol=1e-5)
            assert len(LOG) == len(eager_log) == 1  # the side effect ran once per call
    stats = tpuc.stats()
    assert stats["graphs_compiled"] >= 2, stats  # partitions on both sides of the custom ops
    assert "tpuc_fallback.scale_groups.default" in stats["fallback_ops"], stats
