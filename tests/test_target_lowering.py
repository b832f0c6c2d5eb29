"""Training graphs lower entirely for a TPU target: a target's graphs have no PyTorch escape (on
the CPU plugin an op without a rule runs in PyTorch). The forward and backward graphs of small
models built from the ops bench/backward_sweep.py found without a rule (each rule's numbers are
checked against eager in tests/test_ops.py) go through the sweep's check: no node without a rule,
and `_native.Target.lower` (the target's lowering, without XLA:TPU's compile) succeeds. One real
compile for v5e of the CNN issue 49 reported (`no lowering rule for aten.avg_pool2d_backward`)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpuc
from tpuc import runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None,
    reason="libtpu is not installed (scripts/setup.sh installs it; offline machines skip these)",
)

V5E = "tpu:v5e:2x2"


def _cnn(pool: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), pool, nn.Flatten(), nn.LazyLinear(4))


class _WithUpdate(nn.Module):
    """Training BatchNorm as export traces it (`_batch_norm_with_update`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3) + 0.5)
        self.bias = nn.Parameter(torch.zeros(3))
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x):
        return torch.ops.aten._batch_norm_with_update(
            x, self.weight, self.bias, self.mean, self.var, 0.1, 1e-5
        )[0]


class _Fn(nn.Module):
    """`fn(x, weight)` with a trainable weight of shape `wshape` (so the backward has a graph
    even where the op's input gradient is not the point)."""

    def __init__(self, fn, wshape):
        super().__init__()
        torch.manual_seed(0)
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(wshape))

    def forward(self, x):
        out = self.fn(x, self.weight)
        return sum(o.float().sum() for o in out) if isinstance(out, tuple) else out


_IDX = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 7, 7, 0, 1])
_OFFSETS = torch.tensor([0, 4, 4, 9])
_MASK = torch.arange(2 * 3 * 8 * 8).reshape(2, 3, 8, 8) % 3 == 0


def _bags(x, w):
    bag = F.embedding_bag
    psw = w.flatten()[: _IDX.numel()] * x.mean()
    return (
        bag(_IDX, w, _OFFSETS, mode="sum", per_sample_weights=psw),
        bag(_IDX, w, _OFFSETS, mode="mean", padding_idx=7),
        bag(_IDX, w, _OFFSETS, mode="max"),
    )


# name: (module, input shape)
CASES = {
    "avg_pool2d": (lambda: _cnn(nn.AvgPool2d(2)), (2, 3, 12, 12)),
    "avg_pool2d_ceil_no_pad_count": (
        lambda: _cnn(nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
        (2, 3, 11, 12),
    ),
    "avg_pool3d": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3), nn.AvgPool3d(2)), (2, 2, 6, 7, 8)),
    "max_pool3d": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3), nn.MaxPool3d(2)), (2, 2, 6, 7, 8)),
    "adaptive_max_pool2d": (lambda: _cnn(nn.AdaptiveMaxPool2d((3, 4))), (2, 3, 10, 9)),
    "adaptive_max_pool3d": (
        lambda: nn.Sequential(nn.Conv3d(2, 4, 1), nn.AdaptiveMaxPool3d(2)),
        (1, 2, 5, 4, 6),
    ),
    "replication_pad1d": (lambda: nn.Sequential(nn.ReplicationPad1d((2, 1)), nn.Conv1d(3, 4, 3)), (2, 3, 9)),
    "replication_pad2d": (lambda: _cnn(nn.ReplicationPad2d((1, 2, 0, 3))), (2, 3, 8, 8)),
    "replication_pad3d": (lambda: nn.Sequential(nn.ReplicationPad3d(1), nn.Conv3d(2, 2, 3)), (1, 2, 4, 4, 4)),
    "conv_transpose2d": (
        lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, 2, 1, output_padding=1)),
        (2, 3, 5, 6),
    ),
    "batch_norm_with_update": (lambda: _WithUpdate(), (4, 3, 5, 5)),
    # Ops of bench/backward_sweep.py's OpInfo table (checked against eager in
    # tests/test_training_ops.py).
    # sgn's gradient is `_efficientzerotensor` where it is a graph output as it stands.
    "sgn": (lambda: _Fn(lambda x, w: torch.sgn(w) + x, (5,)), (3, 5)),
    "masked_scatter": (
        lambda: _Fn(lambda x, w: x.masked_scatter(_MASK, w), (2 * 3 * 8 * 8,)),
        (2, 3, 8, 8),
    ),
    "grid_sample_2d": (
        lambda: _Fn(
            lambda x, w: F.grid_sample(x, torch.tanh(w), "bilinear", "reflection", False), (2, 5, 4, 2)
        ),
        (2, 3, 8, 8),
    ),
    "grid_sample_3d": (
        lambda: _Fn(lambda x, w: F.grid_sample(x, torch.tanh(w), "nearest", "border", True), (2, 3, 4, 2, 3)),
        (2, 3, 4, 5, 6),
    ),
    "cdist": (lambda: _Fn(lambda x, w: torch.cdist(x, w, p=1.5), (2, 6, 4)), (2, 5, 4)),
    "pdist": (lambda: _Fn(lambda x, w: F.pdist(x * w, p=3.0), (4,)), (7, 4)),
    "embedding_bag": (lambda: _Fn(_bags, (10, 6)), (4, 3)),
    "upsample_bilinear2d_aa": (
        lambda: _Fn(
            lambda x, w: F.interpolate(x * w, size=(5, 7), mode="bilinear", antialias=True), (3, 1, 1)
        ),
        (2, 3, 12, 10),
    ),
    "mode": (lambda: _Fn(lambda x, w: torch.mode(x * w, 1).values, (1, 9)), (4, 9)),
    # Weight gradients over 32x32 positions: patch products on a TPU at HIGHEST precision.
    "conv_32x32": (lambda: _cnn(nn.MaxPool2d(2)), (2, 3, 32, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_graphs_lower_for_a_target(name):
    import backward_sweep

    make, shape = CASES[name]
    model = make()
    x = torch.randn(shape)
    model(x)  # materializes lazy modules
    checker = backward_sweep.Checker(V5E)
    torch._dynamo.reset()
    out = torch.compile(model, backend=checker.backend)(x)
    out.sum().backward()
    assert dict(checker.graphs) == {"forward": 1, "backward": 1}
    assert not checker.missing and not checker.errors, (dict(checker.missing), dict(checker.errors))


def test_a_cnn_with_average_pooling_compiles_its_training_step_for_a_tpu(tmp_path):
    model = _cnn(nn.AvgPool2d(2))
    x = torch.randn(4, 3, 16, 16)
    model(x)
    torch._dynamo.reset()
    report = tpuc.precompile(
        model, [x], options={"target": V5E, "cache_dir": str(tmp_path / "cache")}, training=True
    )
    assert [g["name"].split("_")[-1] for g in report["per_graph"]] == ["forward", "backward"]
    assert all(g["cache"] == "miss" for g in report["per_graph"])
