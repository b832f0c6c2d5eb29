"""Backward ops a TPU target needs rules for (bench/backward_sweep.py found them without one; on
the CPU plugin they ran in PyTorch): each compiled with fallback="error" on the CPU plugin, so
the rule itself runs, and compared with eager PyTorch. tests/test_target_lowering.py lowers a
training model of each for v5e."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpuc
from tpuc import partitions

NAN = float("nan")


def _ramp(y: torch.Tensor) -> torch.Tensor:
    """y times a ramp, so every output element gets a distinct gradient."""
    return y * torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).reshape(y.shape)


def _grads_vs_eager(f, *xs, rtol=1e-5, atol=1e-5):
    """The gradients of sum(ramp * f(*xs)) (every output of f) for each floating `x`, compiled
    (no fallback) and eager."""
    grads = []
    torch._dynamo.reset()
    for fn in (f, torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})):
        leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
        out = fn(*leaves)
        outs = out if isinstance(out, list | tuple) else [out]
        sum(_ramp(y).sum() for y in outs).backward()
        grads.append([x.grad for x in leaves if x.requires_grad])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    stats = tpuc.stats()
    assert stats["fallback_ops"] == {} and stats["graphs_compiled"] >= 2  # forward and backward


def test_sgn_gradient_is_an_efficient_zero_tensor():
    """sgn's backward of a real input is `_efficientzerotensor` (zeros) where it is a gradient
    as it stands (added to another, PyTorch materializes zeros instead)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 33, generator=g), torch.randn(6, 33, generator=g)
    _grads_vs_eager(lambda x, y: (torch.sgn(x), y * y), x, y)


def test_masked_scatter_gradient():
    """`masked_scatter_backward`: the source's gradient is the output gradient where the
    (broadcast) mask is true, in row-major order, then zeros up to the source's size."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, 17, generator=g)
    src = torch.randn(700, generator=g)  # more than the mask selects
    mask = torch.rand(4, 9, 17, generator=g) > 0.4
    row_mask = torch.rand(9, 1, generator=g) > 0.5  # broadcast
    _grads_vs_eager(lambda x, s: (x.masked_scatter(mask, s), x.masked_scatter(row_mask, s)), x, src)


# (dims, mode, padding, align_corners): bilinear 2-d with every padding both ways (its grid
# gradient goes through each padding's derivative); the other combinations spread over both.
GRID_CASES = [
    *((2, "bilinear", pad, align) for pad in ("zeros", "border", "reflection") for align in (False, True)),
    (2, "bicubic", "reflection", False),
    (2, "bicubic", "border", True),
    (2, "nearest", "border", False),
    (2, "nearest", "reflection", True),
    (3, "bilinear", "reflection", False),
    (3, "bilinear", "border", True),
    (3, "nearest", "zeros", True),
]


@pytest.mark.parametrize("nd,mode,pad,align", GRID_CASES)
def test_grid_sample_gradients(nd, mode, pad, align):
    """grid_sampler_2d/3d_backward, every mode and padding of the forward rule (bicubic is
    2-d only): input gradients scatter each tap's weighted output gradient, grid gradients
    follow the weights' and the padding's derivatives (PyTorch's CPU kernels)."""
    g = torch.Generator().manual_seed(8)
    if nd == 2:
        x = torch.randn(2, 5, 9, 11, generator=g)
        grid = torch.rand(2, 7, 6, 2, generator=g) * 2.6 - 1.3  # some points outside [-1, 1]
    else:
        x = torch.randn(2, 3, 5, 6, 7, generator=g)
        grid = torch.rand(2, 4, 3, 5, 3, generator=g) * 2.6 - 1.3
    _grads_vs_eager(lambda x, grid: F.grid_sample(x, grid, mode, pad, align), x, grid, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wants", [(True, False), (False, True)])
def test_grid_sample_gradient_of_one_operand(wants):
    """Only the input's or only the grid's gradient wanted (output_mask): the other result is
    recorded or not as PyTorch's kernel gives it (the grid's always is)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 9, 11, generator=g)
    grid = torch.rand(2, 7, 6, 2, generator=g) * 2.6 - 1.3

    def f(x, grid):
        return F.grid_sample(x, grid, "bilinear", "border", False)

    torch._dynamo.reset()
    grads = []
    for fn in (f, torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})):
        leaves = [t.clone().requires_grad_(w) for t, w in zip((x, grid), wants, strict=True)]
        _ramp(fn(*leaves)).sum().backward()
        grads.append([t.grad for t in leaves if t.requires_grad])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["fallback_ops"] == {}


def test_cdist_and_pdist_gradients():
    """`_cdist_backward` / `_pdist_backward` for every p PyTorch's kernel tells apart (0, < 1,
    1, < 2, 2, > 2, inf), with a zero distance (gradient 0 there) and broadcast batch dims."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 13, 9, generator=g)
    b = torch.randn(1, 11, 9, generator=g)
    a[0, 1] = b[0, 2]
    x = torch.randn(17, 10, generator=g)
    x[4] = x[7]
    ps = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))

    def f(a, b, x):
        cd = [torch.cdist(a, b, p=p, compute_mode="donot_use_mm_for_euclid_dist") for p in ps]
        return cd + [F.pdist(x, p=p) for p in ps]

    _grads_vs_eager(f, a, b, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_resize_gradients(mode):
    """`_upsample_bilinear2d_aa_backward` / `_upsample_bicubic2d_aa_backward`: the transposed
    resampling of the forward's taps (down- and upsampling, align_corners, explicit scales)."""
    x = torch.randn(2, 3, 10, 20, generator=torch.Generator().manual_seed(11))
    op = getattr(torch.ops.aten, f"_upsample_{mode}2d_aa").default

    def f(x):
        return (
            op(x, [3, 3], False),
            op(x, [17, 34], False),
            op(x, [4, 7], True),
            op(x, [17, 18], False, 1.7, 0.9),
            F.interpolate(x, scale_factor=0.5, mode=mode, antialias=True),
        )

    _grads_vs_eager(f, x, rtol=1e-5, atol=1e-5)


def _bags():
    g = torch.Generator().manual_seed(9)
    w = torch.randint(-4, 5, (40, 16), generator=g).float()  # ties for max
    idx = torch.randint(0, 40, (60,), generator=g)
    idx[:5] = 7
    offsets = torch.tensor([0, 4, 4, 10, 25, 25, 40, 59])  # empty bags; 7 is padding below
    return w, idx, offsets, torch.randn(60, generator=g)


@pytest.mark.parametrize(
    "args",
    [
        (False, 0),
        (False, 1),
        (False, 2),
        (False, 1, False, None, False, 7),
        (False, 2, False, None, False, 7),
        (False, 0, False, "psw"),
        (False, 2, False, None, True),
        (False, 1, False, None, True, 7),
    ],
)
def test_embedding_bag_bookkeeping_results(args):
    """`_embedding_bag`'s offset2bag, bag_size and max_indices (what its backward reads) equal
    PyTorch's CPU kernel's: bag_size less padding positions (zeros for sums), max_indices the
    first row holding each maximum (bag_size's copy for sums and means)."""
    w, idx, offsets, psw = _bags()
    args = tuple(psw if a == "psw" else a for a in args)
    if len(args) > 4 and args[4]:
        offsets = torch.cat([offsets, torch.tensor([60])])

    def f(w, i, o):
        return torch.ops.aten._embedding_bag.default(w, i, o, *args)

    torch._dynamo.reset()
    got = torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})(w, idx, offsets)
    want = f(w, idx, offsets)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for k in (1, 2, 3):
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])


def test_embedding_bag_gradients():
    """`_embedding_bag_backward` (sum, mean, max; padding_idx, include_last_offset,
    scale_grad_by_freq, 2-d indices) and `_embedding_bag_per_sample_weights_backward`."""
    w, idx, offsets, psw = _bags()
    last = torch.cat([offsets, torch.tensor([60])])
    bag = F.embedding_bag

    def f(w, psw):
        return (
            bag(idx, w, offsets, mode="sum"),
            bag(idx, w, offsets, mode="mean"),
            bag(idx, w, offsets, mode="max"),
            bag(idx, w, offsets, mode="mean", padding_idx=7),
            bag(idx, w, last, mode="max", padding_idx=7, include_last_offset=True),
            bag(idx, w, offsets, mode="sum", padding_idx=7, scale_grad_by_freq=True),
            bag(idx, w, offsets, mode="mean", scale_grad_by_freq=True),
            bag(idx, w, offsets, mode="sum", per_sample_weights=psw),
            bag(idx, w, last, mode="sum", per_sample_weights=psw, padding_idx=7, include_last_offset=True),
            bag(idx.view(6, 10), w, mode="mean"),
        )

    _grads_vs_eager(f, w, psw, rtol=1e-5, atol=1e-5)


def test_mode_values_indices_and_gradient(monkeypatch):
    """`mode` as PyTorch's CPU kernel gives it: each row insertion-sorted (stable up to 16
    elements), the first longest run's value and its last index; NaNs land where that sort
    leaves them. Longer rows (std::sort's unstable order) run in PyTorch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 3, 16), generator=g).float()
    x[torch.rand(x.shape, generator=g) < 0.15] = NAN
    xi = torch.randint(-3, 3, (20, 9), generator=g)

    def f(x, xi):
        return (
            torch.mode(x),
            torch.mode(x[:, :, :5], 1, keepdim=True),
            torch.mode(xi, 1),
            torch.mode(xi > 0, 1),
            torch.mode(x[0, 0, 0]),
        )

    torch._dynamo.reset()
    got = torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})(x, xi)
    for (gv, gi), (wv, wi) in zip(got, f(x, xi), strict=True):
        torch.testing.assert_close(gv, wv, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(gi, wi)
    xg = torch.randint(0, 4, (8, 12), generator=g).float()
    _grads_vs_eager(lambda x: torch.mode(x, 1).values, xg, rtol=0, atol=0)
    # 17 elements: std::sort's unstable order decides the index; the op runs in PyTorch.
    long = torch.randint(0, 3, (5, 17), generator=g).float()
    torch._dynamo.reset()
    monkeypatch.setattr(partitions, "_warned_fallback", set())  # other tests may have warned already
    with pytest.warns(UserWarning, match=r"aten\.mode\.default"):
        v, i = torch.compile(lambda x: torch.mode(x, 1), backend="tpu", dynamic=False)(long)
    want = torch.mode(long, 1)
    assert torch.equal(v, want.values) and torch.equal(i, want.indices)
    assert tpuc.stats()["fallback_ops"] == {"aten.mode.default": 1}
