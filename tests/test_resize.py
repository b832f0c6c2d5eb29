"""Bilinear resizing as eager computes it (issue 40): `F.interpolate(mode="bilinear")` of static
shape equals eager's to a unit in the last place. Through PyTorch's decomposition, XLA fused the
source coordinate's multiply and subtract, and the resized image was 1e-5 (relative) off eager's,
which decided near-tied detections (retinanet_resnet50_fpn with weights N(0, 0.05))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpuc import resize

NO_CACHE = {"cache_dir": None}
ULP = {torch.float32: 2.0**-23, torch.float64: 2.0**-52}

# (input HxW, F.interpolate keywords): detection's resizes (200x240 -> 186x224, 180x160 ->
# 224x199, 300x300 for SSD), up and down, the scales eager takes when the output size is not
# recomputed, align_corners, an unchanged size (eager copies), sizes 1 and 17.
CASES = [
    ((200, 240), {"scale_factor": 224 / 240, "recompute_scale_factor": True}),
    ((180, 160), {"scale_factor": 224 / 180, "recompute_scale_factor": True}),
    ((200, 240), {"size": (300, 300)}),
    ((17, 64), {"size": (33, 100)}),
    ((64, 17), {"scale_factor": 0.7}),
    ((33, 50), {"scale_factor": (1.5, 0.35)}),
    ((17, 64), {"size": (40, 9), "align_corners": True}),
    ((1, 17), {"size": (1, 4099)}),
    ((64, 64), {"size": (64, 64)}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{CASES[i][1]}")
def test_bilinear_resize_is_eagers_to_an_ulp(case, dtype):
    (h, w), kw = CASES[case]
    g = torch.Generator().manual_seed(case)
    x = torch.rand(2, 3, h, w, generator=g, dtype=dtype)

    def f(x):
        return F.interpolate(x, mode="bilinear", **kw) * 2

    torch._dynamo.reset()
    got = torch.compile(f, backend="tpu", dynamic=False, options=NO_CACHE)(x)
    expected = f(x)
    assert got.shape == expected.shape
    # Values in [0, 2): 4 units of 1 (2 of the largest value; XLA may fuse the sums' multiply-adds).
    err = (got - expected).abs().max().item()
    assert err <= 4 * ULP[dtype], (err, err / ULP[dtype])


def test_channels_last_input_and_a_dynamic_size_stay_eagers():
    # Channels-last input: the same values. A size Dynamo made symbolic keeps PyTorch's
    # decomposition (the taps cannot be computed before the size is known): rounding-close.
    g = torch.Generator().manual_seed(0)

    def f(x):
        return F.interpolate(x, scale_factor=1.25, mode="bilinear", recompute_scale_factor=True)

    x = torch.rand(2, 16, 24, 40, generator=g).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    torch.testing.assert_close(
        torch.compile(f, backend="tpu", options=NO_CACHE)(x), f(x), rtol=0, atol=2.4e-7
    )
    compiled = torch.compile(f, backend="tpu", dynamic=True, options=NO_CACHE)
    for w in (40, 56):
        x = torch.rand(1, 3, 24, w, generator=g)
        torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=3e-5)


def test_only_static_float_bilinear_calls_are_rewritten():
    def f(x, y):
        a = F.interpolate(x, size=(9, 9), mode="bilinear")
        b = F.interpolate(x, size=(9, 9), mode="nearest")
        c = F.interpolate(x, size=(9, 9), mode="bilinear", antialias=True)
        d = F.interpolate(y, size=(9, 9), mode="bilinear")  # bfloat16: left to the decomposition
        return a, b, c, d

    gms = []

    def backend(gm, example_inputs):
        gms.append((resize.static_bilinear(gm), gm))
        return gm

    x = torch.rand(1, 2, 5, 7)
    torch._dynamo.reset()
    out = torch.compile(f, backend=backend, dynamic=False)(x, x.bfloat16())
    ((count, gm),) = gms
    assert count == 1
    for a, b in zip(out, f(x, x.bfloat16()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2.4e-7)
