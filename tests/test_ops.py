"""Small functions exercising op families and dtypes (int64, int32, bool, fp16, bf16)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import tpuc
from tpuc import runtime


def check(fn, *args, rtol=1e-5, atol=1e-5, equal_nan=False, **options):
    expected = fn(*args)
    actual = torch.compile(fn, backend="tpu", dynamic=False, options=options or None)(*args)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=equal_nan)
    assert tpuc.stats()["fallback_ops"] == {}
    return actual


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_arithmetic_and_comparisons(dtype):
    a = torch.randint(-50, 50, (4, 5), dtype=dtype)
    b = torch.randint(1, 9, (4, 5), dtype=dtype)

    def f(a, b):
        return (a + 3 * b) * 2 - b, a // b, a % b, torch.maximum(a, b), (a > b) & (b < 5), a.sum(1), a.neg()

    check(f, a, b)


def test_bool_logic_and_where():
    a = torch.rand(3, 7) > 0.5
    b = torch.rand(3, 7) > 0.3
    x = torch.randn(3, 7)

    def f(a, b, x):
        return a & b, a | ~b, a ^ b, torch.where(a, x, -x), a.any(1), b.all(), (x > 0).sum()

    check(f, a, b, x)


def test_casts_between_all_supported_dtypes():
    x = torch.randn(4, 6) * 10

    def f(x):
        return (
            x.to(torch.bfloat16),
            x.to(torch.float16),
            x.to(torch.int64),
            x.to(torch.int32),
            x.to(torch.bool),
            x.to(torch.int32).to(torch.float32),
        )

    check(f, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activations_and_normalizations(dtype):
    x = torch.randn(2, 5, 16, dtype=dtype)
    w = torch.randn(16, dtype=dtype)
    b = torch.randn(16, dtype=dtype)

    def f(x, w, b):
        return (
            F.gelu(x),
            F.gelu(x, approximate="tanh"),
            F.silu(x),
            torch.sigmoid(x),
            torch.tanh(x),
            F.softmax(x, -1),
            F.log_softmax(x, 1),
            F.layer_norm(x, (16,), w, b),
        )

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check(f, x, w, b, rtol=tol, atol=tol)


def test_reductions_and_shapes():
    x = torch.randn(2, 3, 4, 5)

    def f(x):
        return (
            x.sum((1, 3), keepdim=True),
            x.mean(-1),
            x.amax(2),
            x.var(1),
            x.permute(3, 1, 0, 2).reshape(5, -1),
            x[:, 1:, ::2],
            x.select(2, -1),
            torch.cat([x, x * 2], 1),
            x.unsqueeze(0).expand(3, 2, 3, 4, 5),
            F.pad(x, (1, 2, 0, 1), value=-1.0),
        )

    check(f, x)


def test_matmul_family_and_embedding():
    a = torch.randn(3, 4, 5)
    b = torch.randn(3, 5, 6)
    w = torch.randn(10, 8)
    idx = torch.tensor([[1, 9, 0], [3, 3, 7]])

    def f(a, b, w, idx):
        return (
            torch.bmm(a, b),
            a @ b[0],
            torch.baddbmm(torch.ones(3, 4, 6), a, b, alpha=0.5),
            F.embedding(idx, w),
        )

    check(f, a, b, w, idx)


def test_arange_full_and_masks():
    x = torch.randn(6, 6)

    def f(x):
        mask = torch.arange(6).unsqueeze(0) <= torch.arange(6).unsqueeze(1)
        return (
            x.masked_fill(~mask, float("-inf")).softmax(-1),
            torch.full((2, 3), 7.5),
            torch.arange(1, 10, 3),
        )

    check(f, x)


@pytest.mark.parametrize("precision,attr", [("highest", "HIGHEST"), ("high", "HIGH"), ("medium", "DEFAULT")])
def test_matmul_precision_follows_torch_setting(tmp_path, precision, attr):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        a, b = torch.randn(4, 8), torch.randn(8, 3)
        check(lambda a, b: a @ b, a, b, rtol=1e-2, atol=1e-2, dump_dir=str(tmp_path))
    finally:
        torch.set_float32_matmul_precision(previous)
    modules = list(tmp_path.glob("*/stablehlo.mlir"))
    assert len(modules) == 1
    assert f"#stablehlo<precision {attr}>" in modules[0].read_text()


def test_explicit_precision_option_overrides_torch(tmp_path):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    check(lambda a, b: a @ b, a, b, rtol=1e-2, atol=1e-2, precision="default", dump_dir=str(tmp_path))
    text = next(tmp_path.glob("*/stablehlo.mlir")).read_text()
    assert "#stablehlo<precision DEFAULT>" in text


def test_dim_zero_of_a_0d_tensor():
    # PyTorch accepts dim 0 / -1 on a 0-d tensor; these used to panic in the lowering.
    x = torch.tensor(1.5)
    check(
        lambda x: (x.mean(dim=0, keepdim=True), x.mean(dim=-1), torch.index_select(x, 0, torch.tensor([0]))),
        x,
    )


def test_tpuc_precompile_stays_the_function_after_the_backend_is_imported():
    # A submodule named like the function would replace `tpuc.precompile` once imported.
    check(lambda x: x + 1, torch.randn(3))
    assert callable(tpuc.precompile) and tpuc.precompile.__name__ == "precompile"


def test_sort_topk_median_order_nans_and_ties_like_torch():
    x = torch.tensor([[3.0, float("nan"), -1.0, 3.0, 0.0, -0.0], [2.0, 2.0, -5.0, float("nan"), 7.0, 1.0]])

    def f(x):
        return (
            torch.sort(x, dim=1, stable=True),
            torch.sort(x, dim=1, descending=True, stable=True),
            torch.argsort(x, dim=0, stable=True),
            torch.cummax(x, 1),
            torch.cummin(x, 1),
            torch.logcumsumexp(x, 1),
            torch.searchsorted(torch.tensor([-1.0, 0.0, 2.0, 2.0, 7.0]), x, right=True),
        )

    check(f, x, equal_nan=True, fallback="error")
    # Without ties (PyTorch leaves the order of tied indices unspecified for these).
    y = torch.tensor(
        [[3.5, float("nan"), -1.0, 3.0, 0.5, -0.25, 9.0], [2.0, 2.5, -5.0, float("nan"), 7.0, 1.0, 0.0]]
    )
    check(
        lambda y: (
            torch.topk(y, 3, dim=1),
            torch.topk(y, 2, dim=1, largest=False),
            torch.kthvalue(y, 2, dim=1),
            torch.median(y, dim=1),
            torch.nanmedian(y, dim=1),
            torch.median(y[:, :3]),
        ),
        y,
        equal_nan=True,
        fallback="error",
    )


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_and_index_reduce_modes(include_self):
    x = torch.randn(4, 5)
    src = torch.randn(6, 5)
    idx = torch.tensor(
        [[0, 1, 2, 3, 0], [0, 0, 1, 1, 2], [3, 3, 3, 0, 0], [1, 2, 3, 0, 1], [2, 2, 2, 2, 2], [0, 3, 1, 2, 0]]
    )
    index = torch.tensor([0, 2, 2, 3, 0, 1])

    def f(x, src, idx, index):
        out = []
        for reduce in ("sum", "prod", "mean", "amax", "amin"):
            out.append(x.scatter_reduce(0, idx, src, reduce, include_self=include_self))
        for reduce in ("prod", "mean", "amax", "amin"):
            out.append(x.index_reduce(0, index, src[:, :5], reduce, include_self=include_self))
        return out

    check(f, x, src, idx, index, fallback="error")


def test_index_put_with_boolean_mask():
    """`x[mask] = values` with one value per True element (leading and inner masks, accumulate,
    one broadcast value): each True position's rank picks its value, in static shapes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 3, generator=g)
    m2 = torch.randn(4, 5, generator=g) > 0
    m1 = torch.tensor([True, False, True, True, False])
    v2 = torch.randn(int(m2.sum()), 3, generator=g)
    v1 = torch.randn(4, 3, 3, generator=g)

    def f(x, m2, m1, v2, v1):
        op = torch.ops.aten.index_put.default
        y = x.clone()
        y[m2] = v2
        return (
            y,
            op(x, [m2], v2, True),
            op(x, [None, m1], v1),
            op(x, [None, m1], v1, True),
            op(x, [m2], torch.tensor([2.5])),
        )

    check(f, x, m2, m1, v2, v1, fallback="error")


def test_index_put_of_one_index_into_an_input_is_a_select(tmp_path):
    """One index written into a graph input (a KV cache's `index_copy_` at a decode step) is a
    select over the input, not a scatter, whatever dim, index form (0-d, one element, negative,
    int32), value broadcast or dtype; several indices, accumulation and targets computed in the
    graph stay scatters."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(1, 4, 9, 6, generator=g)
    ints = torch.arange(24, dtype=torch.int32).view(4, 6)
    row = torch.randn(1, 4, 1, 6, generator=g)

    def f(cache, ints, row, pos, neg, i32):
        op = torch.ops.aten.index_put.default
        return (
            op(cache, [None, None, pos], row),  # the decode step
            op(cache, [None, None, neg], row[:, :, 0]),  # 0-d negative index
            op(cache, [i32], torch.tensor(2.5)),  # dim 0, one broadcast value
            op(ints, [None, pos], torch.tensor([7], dtype=torch.int32)),
        )

    pos, neg, i32 = torch.tensor([4]), torch.tensor(-2), torch.tensor([0], dtype=torch.int32)
    check(f, cache, ints, row, pos, neg, i32, fallback="error", dump_dir=str(tmp_path / "select"))
    (module,) = (tmp_path / "select").glob("*/stablehlo.mlir")
    assert "stablehlo.scatter" not in module.read_text()

    def g2(cache, row, two):
        op = torch.ops.aten.index_put.default
        return (
            op(cache, [None, None, two], row.expand(1, 4, 2, 6)),  # two indices
            op(cache, [None, None, two[:1]], row, True),  # accumulate
            op(cache * 2, [None, None, two[:1]], row),  # not an input: in place in XLA
        )

    check(g2, cache, row, torch.tensor([1, 7]), fallback="error", dump_dir=str(tmp_path / "scatter"))
    (module,) = (tmp_path / "scatter").glob("*/stablehlo.mlir")
    assert module.read_text().count('"stablehlo.scatter"(') == 3


def test_index_put_with_boolean_mask_checks_the_value_count():
    """A value count other than the mask's True count raises, as in eager, instead of writing
    clamped or unused values (the count is checked on the host after the call)."""

    def f(x, m, v):
        return torch.ops.aten.index_put.default(x, [m], v)

    x = torch.randn(6)
    m = torch.tensor([True, False, True, True, False, False])
    fn = torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})
    torch.testing.assert_close(fn(x, m, torch.ones(3)), f(x, m, torch.ones(3)))
    # No values for an all-False mask (GLM-Image's `emb[drop] *= 0` with nothing dropped).
    none = torch.zeros(6, dtype=torch.bool)
    torch.testing.assert_close(fn(x, none, torch.ones(0)), f(x, none, torch.ones(0)))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        fn(x, m, torch.ones(0))
    for wrong in (torch.tensor([True, True, True, True, False, False]), torch.tensor([True] + [False] * 5)):
        with pytest.raises(RuntimeError, match="shape mismatch"):
            f(x, wrong, torch.ones(3))
        with pytest.raises(RuntimeError, match="shape mismatch"):
            fn(x, wrong, torch.ones(3))


def test_pooling_variants_and_transposed_convolution():
    x = torch.randn(2, 4, 7, 9)
    w = torch.randn(4, 3, 3, 2)
    gw, gb = torch.rand(4) + 0.5, torch.randn(4)

    def f(x, w, gw, gb):
        return (
            F.adaptive_avg_pool2d(x, (3, 4)),
            F.adaptive_max_pool2d(x, (4, 5), return_indices=True),
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            F.avg_pool2d(x, (2, 3), 2, (1, 1), divisor_override=5),
            F.conv_transpose2d(
                x, w, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2)
            ),
            F.group_norm(x, 2, gw, gb),
        )

    check(f, x, w, gw, gb, rtol=1e-4, atol=1e-4, fallback="error")


def _grad_vs_eager(f, x, rtol=1e-5, atol=1e-5):
    """x's gradient of sum(f(x) * ramp) compiled (no fallback) and eager."""

    def weighted(x):
        y = f(x)
        return y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)

    grads = []
    for fn in (
        weighted,
        torch.compile(weighted, backend="tpu", dynamic=False, options={"fallback": "error"}),
    ):
        xg = x.clone().requires_grad_()
        fn(xg).sum().backward()
        grads.append(xg.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=rtol, atol=atol)
    stats = tpuc.stats()
    assert stats["fallback_ops"] == {} and stats["graphs_compiled"] >= 2  # forward and backward


@pytest.mark.parametrize(
    "shape,args",
    [
        ((2, 3, 13, 12), (3, 2, 1)),  # ResNet's stem pooling: overlapping windows
        ((2, 3, 13, 12), (3, 2, 1, 1, True)),  # ceil_mode: a last window past the input
        ((3, 10, 11), ((2, 3), (1, 2), (1, 0), (2, 1))),  # unbatched, dilated, asymmetric
        ((1, 2, 12, 12), (5, 2, 2)),  # 25 taps: the scatter path
    ],
)
def test_max_pool_gradient(shape, args):
    """Tap by tap up to 16 taps, else a scatter. Integer-valued inputs make ties, so the
    gradient must follow the forward's chosen indices exactly."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-3, 4, shape, generator=g).float()
    _grad_vs_eager(lambda x: F.max_pool2d(x, *args), x, rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape,args,kwargs",
    [
        ((2, 3, 13, 12), (2,), {}),  # the training CNN's pooling
        (
            (2, 3, 13, 12),
            (3, 2, 1),
            {"ceil_mode": True, "count_include_pad": False},
        ),  # a last window past the input
        ((2, 3, 11, 10), ((2, 3), (1, 2), (1, 0)), {"divisor_override": 5}),  # overlapping, asymmetric
        ((3, 10, 11), (3, 1), {}),  # unbatched, stride 1
        ((1, 2, 6, 7, 8), (3, 2, 1), {"ceil_mode": True}),  # 3-D
    ],
)
def test_avg_pool_gradient(shape, args, kwargs):
    """avg_pool2d/3d_backward: one pad and one windowed sum (a target has no PyTorch escape)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    pool = F.avg_pool3d if len(shape) == 5 else F.avg_pool2d
    _grad_vs_eager(lambda x: pool(x, *args, **kwargs), x, rtol=1e-5, atol=1e-4)


def test_max_pool3d_and_adaptive_max_pool_gradients():
    """By their indices (a scatter); integer-valued inputs make ties, so the gradient must
    follow the forward's chosen indices exactly."""
    g = torch.Generator().manual_seed(5)
    x3 = torch.randint(-3, 4, (2, 2, 6, 7, 5), generator=g).float()
    _grad_vs_eager(lambda x: F.max_pool3d(x, 3, 2, 1), x3, rtol=0, atol=0)
    x2 = torch.randint(-3, 4, (2, 3, 9, 7), generator=g).float()
    _grad_vs_eager(lambda x: F.adaptive_max_pool2d(x, (4, 3)), x2, rtol=0, atol=0)
    _grad_vs_eager(lambda x: F.adaptive_max_pool3d(x, (3, 2, 4)), x3, rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape,pad",
    [
        ((2, 3, 9), (2, 3)),
        ((2, 3, 6, 5), (1, 2, 3, 0)),
        ((2, 3, 6, 5), (-1, 2, 3, -2)),  # negative: the input is cropped
        ((1, 2, 4, 5, 3), (1, 1, 2, 0, 0, 2)),
        ((2, 1, 4), (3, 3)),  # more padding than input on each side
    ],
)
def test_replication_pad_gradient(shape, pad):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    _grad_vs_eager(lambda x: F.pad(x, pad, mode="replicate"), x, atol=1e-4)


@pytest.mark.parametrize(
    "xs,ws,kw",
    [
        ((2, 4, 5, 5), (4, 3, 3, 3), {"stride": 2, "padding": 1}),
        (
            (2, 4, 5, 6),
            (4, 3, 3, 2),
            {"stride": (2, 1), "padding": (1, 0), "output_padding": (1, 0), "groups": 2, "dilation": (1, 2)},
        ),
        ((2, 6, 7), (6, 2, 4), {"stride": 3, "padding": 2, "output_padding": 2, "groups": 3}),
        ((1, 2, 3, 4, 3), (2, 3, 2, 3, 2), {"stride": 2, "padding": (0, 1, 0), "output_padding": 1}),
    ],
)
def test_transposed_convolution_gradients(xs, ws, kw):
    """Input, weight and bias gradients of conv_transpose1d/2d/3d: the input gradient is the
    forward convolution by the same weight, the weight gradient that convolution's weight
    gradient with input and output gradient swapped (a target has no PyTorch escape)."""
    conv = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}[len(xs)]
    g = torch.Generator().manual_seed(4)
    x, w, b = (
        torch.randn(xs, generator=g),
        torch.randn(ws, generator=g),
        torch.randn(ws[1] * kw.get("groups", 1)),
    )

    def f(x, w, b):
        y = conv(x, w, b, **kw)
        return y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / y.numel()

    grads = []
    for fn in (f, torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        fn(*leaves).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["fallback_ops"] == {}


def test_batch_norm_with_update_gradients_and_running_statistics():
    """`_batch_norm_with_update` (training BatchNorm as export traces it): its backward
    (`batch_norm_backward`) is PyTorch's decomposition, so a target can lower it."""
    g = torch.Generator().manual_seed(6)
    x, w, b = (
        torch.randn(4, 3, 5, 5, generator=g),
        torch.rand(3, generator=g) + 0.5,
        torch.randn(3, generator=g),
    )

    def f(x, w, b, rm, rv):
        y, *_ = torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)
        return (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / y.numel()).sum()

    results = []
    for fn in (f, torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        rm, rv = torch.zeros(3), torch.ones(3)
        fn(*leaves, rm, rv).backward()
        results.append([t.grad for t in leaves] + [rm, rv])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["fallback_ops"] == {}


def test_depthwise_convolutions_as_tap_sums(tmp_path):
    # groups == channels is lowered as a sum over the kernel's taps (XLA's CPU grouped convolution
    # is slow): strides, dilations, asymmetric kernels, 1-D, low precision, and a grouped
    # convolution that is not depthwise (XLA's convolution, or oneDNN's where it runs them) side
    # by side.
    x = torch.randn(2, 6, 11, 9)
    w7, w35, wg = torch.randn(6, 1, 7, 7), torch.randn(6, 1, 3, 5), torch.randn(6, 3, 3, 3)
    x1, w1 = torch.randn(2, 4, 13), torch.randn(4, 1, 5)
    b = torch.randn(6)

    def f(x, w7, w35, wg, x1, w1, b):
        y = F.conv2d(x, w7, b, padding=3, groups=6)
        return (
            y,
            F.layer_norm(y.permute(0, 2, 3, 1), (6,)),  # read again: mean, variance, normalize
            F.conv2d(x, w35, None, stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=6),
            F.conv2d(x, wg, b, padding=1, groups=2),
            F.conv1d(x1, w1, None, stride=2, padding=2, groups=4),
        )

    check(f, x, w7, w35, wg, x1, w1, b, rtol=1e-4, atol=1e-4, fallback="error", dump_dir=str(tmp_path))
    (module,) = tmp_path.glob("*/stablehlo.mlir")
    text = module.read_text()
    # Only the groups=2 one.
    assert text.count("stablehlo.convolution") + text.count('"tpuc_conv2d_fwd"') == 1
    half = (x.to(torch.bfloat16), w7.to(torch.bfloat16))
    check(lambda x, w: F.conv2d(x, w, padding=3, groups=6), *half, rtol=2e-2, atol=2e-2)


def test_convolutions_with_few_output_positions_as_tap_products(tmp_path):
    # At most 4 output positions: one matrix product over a slice per output position where
    # there are fewer positions than live taps (those form a box of the kernel), else over a
    # slice per tap; taps over padding only are skipped. Never XLA's convolution (2-D ones are
    # oneDNN's where it runs them: test_host_conv reruns this with it off).
    x1, x2, x4 = torch.randn(2, 8, 1, 1), torch.randn(2, 8, 2, 2), torch.randn(2, 8, 4, 4)
    w3, w1 = torch.randn(5, 8, 3, 3), torch.randn(5, 8, 1, 1)
    xd, wd = torch.randn(2, 3, 4), torch.randn(4, 3, 3)
    b = torch.randn(5)

    def f(x1, x2, x4, w3, w1, xd, wd, b):
        return (
            F.conv2d(x1, w3, b, padding=1),  # only the centre tap reads input
            F.conv2d(x2, w3, None, padding=1),  # every tap reads input: one product
            F.conv2d(x2, w3, b, stride=2, padding=1),  # the live taps: a 2x2 box of the kernel
            F.conv2d(x4, w3, b, stride=2, padding=1),
            F.conv2d(x4, w1, None, stride=2),  # ResNet's downsampling shortcut
            F.conv2d(x4, w3, None, padding=2, dilation=3),
            F.conv2d(x4, w3, b, stride=2, padding=2, dilation=2),  # every tap reads input
            F.conv1d(xd, wd, None, stride=2, padding=1),
        )

    check(f, x1, x2, x4, w3, w1, xd, wd, b, rtol=1e-4, atol=1e-4, fallback="error", dump_dir=str(tmp_path))
    (module,) = tmp_path.glob("*/stablehlo.mlir")
    assert "stablehlo.convolution" not in module.read_text()
    check(lambda x, w: F.conv2d(x, w, padding=1), x2.half(), w3.half(), rtol=2e-2, atol=2e-2)


def test_channels_last_convolution_chain_carries_no_transposes(tmp_path):
    """Forward 2-D convolutions compute channels-last (depthwise ones too), and batch norm,
    ReLU, the residual add, max pooling and the per-channel mean read that layout: in a stem +
    residual block + depthwise convolution + pool + projection, the only activations transposed
    and read are the graph input (into NHWC) and the outputs (back to NCHW, returned); the
    results match eager."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(16, 32, 1)
            self.conv = torch.nn.Conv2d(32, 32, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(32)
            self.depthwise = torch.nn.Conv2d(32, 32, 5, padding=2, groups=32)
            self.proj = torch.nn.Conv2d(32, 64, 1)
            self.bn2 = torch.nn.BatchNorm2d(64)

        def forward(self, x):
            y = self.stem(x)
            y = F.relu(self.bn(self.conv(y))) + y
            y = self.depthwise(y) - y
            z = F.relu(self.bn2(self.proj(F.max_pool2d(y, 2))))
            return z, z.mean((2, 3))

    model = Net().eval()
    for bn in (model.bn, model.bn2):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(8, 16, 16, 16)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="tpu", options={"dump_dir": str(tmp_path), "cache_dir": None})
        actual = compiled(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    (mlir,) = tmp_path.glob("*/stablehlo.mlir")
    lines = mlir.read_text().splitlines()
    conv = '"tpuc_conv2d_fwd"' if runtime.get_runtime(None).host_conv else '"stablehlo.convolution"'
    assert any(conv in line for line in lines), f"the 3x3 convolution is {conv}"

    def operands(line):
        return set(re.findall(r"%[\w#]+", line.split(" = ", 1)[-1]))

    for line in lines:
        # Activations are rank 4; the depthwise kernel is read taps-major (a rank-2 transpose).
        if '"stablehlo.transpose"' not in line or not re.search(r"-> tensor<\d+x\d+x\d+x\d+x", line):
            continue
        name = line.split(" = ")[0].strip()
        if all(v.startswith("%arg") for v in operands(line)):
            continue  # the graph input into NHWC
        readers = [
            r.split('"')[1] for r in lines if name in operands(r) and not r.lstrip().startswith(name + " ")
        ]
        assert set(readers) <= {"func.return"}, (line, readers)


@pytest.mark.parametrize("batch", [1, 3])
def test_pointwise_and_patch_product_convolutions_forward_and_backward(tmp_path, batch):
    # 1x1 convolutions (any stride) are matrix products in NCHW forward and backward; a
    # convolution with batch x positions <= 2 x output channels multiplies the kernel by its
    # patches, and its weight gradient (<= 8x) is the output gradient times the patches.
    # Checked against eager with gradients for input and weight, odd sizes included.
    torch.manual_seed(0)
    x = torch.randn(batch, 6, 7, 5, requires_grad=True)
    w1 = torch.randn(8, 6, 1, 1, requires_grad=True)
    w3 = torch.randn(64, 6, 3, 3, requires_grad=True)
    b = torch.randn(8, requires_grad=True)

    def f(x, w1, w3, b):
        # The strided product's mean, not its sum: y feeds sin(), and a sum of ~70 would turn
        # its last-bit rounding (which depends on the order XLA sums in, NCHW or channels-last)
        # into gradient differences above the tolerance.
        y = (
            F.conv2d(x, w1, b)
            + F.conv2d(x, w1, b, stride=2).mean()
            + F.conv2d(x, w3, padding=1).mean(1, True)
        )
        # stride and dilation: the weight gradient's patches (batch x positions <= 8 x channels)
        z = F.conv2d(x, w3, stride=2, padding=2, dilation=2)
        return y.sin().sum() + z.cos().sum()

    def step(x, w1, w3, b):
        return torch.autograd.grad(f(x, w1, w3, b), (x, w1, w3, b))

    expected = step(x, w1, w3, b)
    actual = torch.compile(step, backend="tpu", options={"dump_dir": str(tmp_path)})(x, w1, w3, b)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    convs = [
        ln
        for m in tmp_path.glob("*/stablehlo.mlir")
        for ln in m.read_text().splitlines()
        # The op, not a location naming an FX node such as convolution_backward.
        if '"stablehlo.convolution"' in ln
    ]
    if runtime.get_runtime(None).host_conv:
        # The 3x3 kernel's gradients are oneDNN's (test_host_conv reruns this with it off).
        assert not convs and any(
            "tpuc_conv2d_bwd" in m.read_text() for m in tmp_path.glob("*/stablehlo.mlir")
        ), convs
    else:
        # Only the 3x3 kernel's backward stays XLA's convolution (its gradients).
        assert convs and all("3x3xf32" in ln for ln in convs), convs


def test_special_functions_and_inverse_trig():
    x = torch.linspace(-4.75, 9.5, 41)
    u = torch.linspace(-0.999, 0.999, 41)

    def f(x, u):
        return (
            torch.lgamma(x),
            torch.digamma(x),
            torch.polygamma(1, x),
            torch.polygamma(3, x.abs() + 0.1),
            torch.erfinv(u),
            torch.erfc(x),
            torch.special.i0(x),
            torch.special.i1e(x),
            torch.asin(u),
            torch.acos(u),
            torch.atanh(u),
            torch.asinh(x),
            torch.sinh(x),
            torch.special.chebyshev_polynomial_t(u, torch.arange(41.0) % 12),
            torch.special.zeta(x.abs() + 1.5, x.abs() + 0.5),
        )

    check(f, x, u, rtol=2e-5, atol=1e-5, fallback="error")


def test_cummax_cummin_over_lengths_that_are_not_powers_of_two():
    # XLA's CPU plugin miscompiled a scan over (value, index) pairs of such lengths (a compile
    # error); tpuc scans a power-of-two length and slices.
    for n in (17, 33, 40):
        x = torch.randint(0, 4, (3, n)).float()
        x[1, n // 2] = float("nan")
        check(
            lambda x: (torch.cummax(x, 1), torch.cummin(x, 0), torch.cummax(x, 1)[1]),
            x,
            equal_nan=True,
            fallback="error",
        )


def test_signed_zeros_of_sign_and_adding_zero():
    # torch.sign(-0.0) is +0.0 and -0.0 + 0 is +0.0: seen through 1/x (inf vs -inf).
    x = torch.tensor([-0.0, 0.0, -2.5, 3.0, float("nan")])
    check(
        lambda x: (1 / torch.sign(x), 1 / (x + 0), 1 / (0.0 + x), 1 / (x + 0.0), 1 / (x - 0.0)),
        x,
        equal_nan=True,
        fallback="error",
    )
