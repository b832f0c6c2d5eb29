"""`prims.fma` (Dynamo's rewrite of `add_(x, alpha=tensor)`, and of `addcmul_` / `addcdiv_` with a
`value`: AdamW's update) compiled by tpuc: `a * b + c` rounded once, bit for bit, at sizes that
reach XLA's vector loops and their tails, and on sums where rounding twice would be wrong."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch._inductor import inductor_prims  # noqa: F401  (registers prims.fma)

import tpuc

N = 4099  # XLA's vector loop and its tail

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _fma_exact(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c correctly rounded to the dtype (ties to even), from exact rationals: the nearest
    of the float64 approximation's neighbours in the dtype."""
    out = torch.empty_like(a)
    bits_dtype = _BITS[a.dtype]
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist(), strict=True)):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        near = torch.tensor(float(exact), dtype=torch.float64).to(a.dtype)
        bits = near.view(bits_dtype).item()
        cands = [torch.tensor(bits + d, dtype=bits_dtype).view(a.dtype) for d in (-1, 0, 1)]
        cands = [t for t in cands if torch.isfinite(t)]

        # Nearest; on a tie, the even one.
        out[i] = min(
            cands, key=lambda t, q=exact: (abs(Fraction(t.item()) - q), t.view(bits_dtype).item() & 1)
        )
    return out


def _halfway_cases(dtype):
    """(a, b, c) whose product is halfway between two floats of `dtype` and whose tiny c decides
    the rounding: rounding the sum in the wider type first would tie, then round to even."""
    bits = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    k, m = bits // 2, bits - bits // 2
    # (1 + 2^-k)(1 + 2^-m) = 1 + 2^-k + 2^-m + 2^-bits: the last term is half a unit.
    a, b = 1 + 2.0**-k, 1 + 2.0**-m
    tiny = 2.0**-100 if dtype != torch.float16 else 2.0**-24
    return [(a, b, tiny), (a, b, -tiny), (-a, b, tiny), (-a, b, -tiny)]


def _operands(dtype, n=N):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(n, generator=g).to(dtype) for _ in range(3))
    c = c * 1e-3
    for i, (x, y, z) in enumerate(_halfway_cases(dtype)):
        for at in (i * 97, n - 1 - i):
            a[at], b[at], c[at] = x, y, z
    return a, b, c


def fma(a, b, c):
    return torch.ops.prims.fma(a, b, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fma_is_rounded_once(dtype):
    a, b, c = _operands(dtype)
    want = _fma_exact(a, b, c)
    wide = torch.float32 if dtype == torch.float16 else torch.float64  # as elementwise.rs
    # The hard cases are hard: where c pushes the sum away from the even neighbour (the first
    # and the last case), rounding twice is wrong.
    for x, y, z in [_halfway_cases(dtype)[i] for i in (0, 3)]:
        twice = (torch.tensor(x, dtype=wide) * y + z).to(dtype)
        assert twice != _fma_exact(*(torch.tensor([v], dtype=dtype) for v in (x, y, z)))[0]
    got = torch.compile(fma, backend="tpu", dynamic=False, options={"fallback": "error"})(a, b, c)
    assert torch.equal(got.view(_BITS[dtype]), want.view(_BITS[dtype])), (got != want).nonzero()


def test_fma_specials_and_broadcast_scalar_b():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([0.0, inf, 3.0, 1.0, -0.0, 3e38])
    b = torch.tensor([inf, 0.0, nan, 2.0, 1.0, 10.0])
    c = torch.tensor([1.0, 1.0, 1.0, -2.0, 0.0, -inf])
    got = torch.compile(fma, backend="tpu", dynamic=False, options={"fallback": "error"})(a, b, c)
    want = torch.tensor([nan, nan, nan, 0.0, 0.0, -inf])
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert not got[4].signbit(), "-0 * 1 + 0 is +0"
    half = torch.compile(lambda a, c: fma(a, 0.5, c), backend="tpu", options={"fallback": "error"})
    x, y = torch.randn(N), torch.randn(N)
    assert torch.equal(half(x, y), _fma_exact(x, torch.full_like(x, 0.5), y))


def test_add_with_a_tensor_alpha_equals_eager_bit_for_bit():
    """Eager's `add_(other, alpha=tensor)` is a fused multiply-add in ATen's CPU kernel; Dynamo
    rewrites it to prims.fma, which tpuc compiles (no PyTorch fallback)."""
    g = torch.Generator().manual_seed(1)
    p, grad = torch.randn(N, generator=g), torch.randn(N, generator=g)
    lr = torch.tensor(-0.0123)

    def update(p, grad, lr):
        return p.clone().add_(grad, alpha=lr)

    got = torch.compile(update, backend="tpu", dynamic=False, options={"fallback": "error"})(p, grad, lr)
    assert tpuc.stats()["fallback_ops"] == {}
    assert torch.equal(got, update(p, grad, lr))


def test_fma_of_float64_runs_in_pytorch():
    """float64 has no wider type to round fma once through: the node runs in PyTorch (its
    eager kernel), counted in fallback_ops."""
    a, b, c = (torch.randn(16, dtype=torch.float64) for _ in range(3))
    got = torch.compile(lambda a, b, c: fma(a, b, c) * 2, backend="tpu")(a, b, c)
    assert tpuc.stats()["fallback_ops"] == {"prims.fma.default": 1}
    assert torch.equal(got, fma(a, b, c) * 2)
    with pytest.raises(tpuc.UnsupportedOpError, match="float64 has none"):
        torch.compile(fma, backend="tpu", options={"fallback": "error"})(a, b, c)
