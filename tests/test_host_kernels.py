"""tpuc's own host kernels (`tpuc_hostkernels::host_rows`, `host_attention`): large f32 layer norms
and CPU flash attentions run as XLA FFI custom calls inside the compiled program (one pass over
memory per row; attention scores kept in the cache per block of query rows). Checked against
eager on the cases their code branches on: affine or not, several normalized dims, a large
mean; attention with a causal mask (also fewer keys than queries), float and bool masks
broadcast over batch, heads or queries, fully masked rows, grouped heads, several query blocks
per head, a NaN. Each module is checked to hold the custom call (or, below the size, not)."""

from __future__ import annotations

import re

import pytest
import torch

from tpuc import runtime

OPTS = {"fallback": "error", "cache_dir": None}


@pytest.fixture
def host_rows():
    rt = runtime.get_runtime(None)
    if not rt.host_attention:
        pytest.skip("no host kernels in this process (TPUC_HOST_KERNELS without rows, or no MKL)")
    return rt


def _compiled_module(fn, args, tmp_path):
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tpu", dynamic=False, options={**OPTS, "dump_dir": str(tmp_path)})(*args)
    text = "".join(p.read_text() for p in tmp_path.glob("*/stablehlo.mlir"))
    return out, text


LAYER_NORMS = {
    "affine": ((1576, 768), (768,), True, 0.0),
    "no_affine": ((4, 128, 768), (768,), False, 0.0),
    "two_dims": ((8, 16, 32, 64), (32, 64), True, 0.0),
    "large_mean": ((3, 70, 1000), (1000,), True, 1000.0),
}


@pytest.mark.parametrize("name", list(LAYER_NORMS))
def test_layer_norm_runs_in_the_row_kernel_and_matches_eager(host_rows, tmp_path, name):
    shape, norm, affine, offset = LAYER_NORMS[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 3 + offset
    w = torch.randn(norm, generator=g) if affine else None
    b = torch.randn(norm, generator=g) if affine else None
    op = torch.ops.aten.native_layer_norm

    def fn(x):
        return op(x, list(norm), w, b, 1e-5)

    got, text = _compiled_module(fn, (x,), tmp_path)
    # Against f64: no further from it than eager is (rows of mean 1000 lose digits either way).
    want = op(x.double(), list(norm), *(t.double() if t is not None else None for t in (w, b)), 1e-5)
    for i, (a, e, r) in enumerate(zip(got, fn(x), want, strict=True)):
        ours, eager = ((t.double() - r).abs().max().item() for t in (a, e))
        assert ours <= max(1.5 * eager, 1e-5), f"result {i}: {ours} from f64 (eager {eager})"
    assert "tpuc_layer_norm" in text


def test_small_layer_norm_stays_in_xla(host_rows, tmp_path):
    x = torch.randn(8, 64)
    ln = torch.nn.LayerNorm(64)
    with torch.no_grad():
        got, text = _compiled_module(ln, (x,), tmp_path)
        torch.testing.assert_close(got, ln(x), rtol=1e-5, atol=1e-5)
    assert "tpuc_layer_norm" not in text


def test_layer_norm_gradients_through_the_row_kernel_match_eager(host_rows, tmp_path):
    """Training reads the kernel's mean and rstd in the backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8))
    x = torch.randn(256, 256)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu", options={**OPTS, "dump_dir": str(tmp_path)})
    compiled(x).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    for a, e in zip(got, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert "tpuc_layer_norm" in "".join(p.read_text() for p in tmp_path.glob("*/stablehlo.mlir"))


def _attention_case(name, g):
    """(q, k, v, kwargs) of each case."""
    sizes = {
        "vit": (8, 12, 12, 197, 197, 64),
        "causal": (1, 12, 12, 128, 128, 64),
        "causal_fewer_keys": (1, 2, 2, 300, 50, 8),
        "grouped_heads": (2, 8, 2, 64, 64, 32),
        "query_blocks": (1, 2, 2, 700, 197, 16),
    }.get(name, (2, 4, 4, 100, 120, 16))
    b, h, hk, n_q, s, d = sizes
    q = torch.randn(b, h, n_q, d, generator=g)
    k = torch.randn(b, hk, s, d, generator=g)
    v = torch.randn(b, hk, s, d, generator=g)
    kwargs = {}
    if name.startswith("causal"):
        kwargs["is_causal"] = True
    elif name == "float_mask":
        kwargs["attn_mask"] = torch.randn(2, 1, 100, 120, generator=g)
    elif name == "bool_mask_per_query":
        kwargs["attn_mask"] = torch.rand(100, 120, generator=g) > 0.3
    elif name == "bool_mask_masks_a_batch":
        m = torch.ones(2, 1, 1, 120, dtype=torch.bool)
        m[1] = False
        kwargs["attn_mask"] = m
    elif name == "scale_and_nan":
        kwargs["scale"] = 0.3
        q[1, 2, 7, 3] = float("nan")
    return q, k, v, kwargs


ATTENTIONS = [
    "vit",
    "causal",
    "causal_fewer_keys",
    "grouped_heads",
    "query_blocks",
    "float_mask",
    "bool_mask_per_query",
    "bool_mask_masks_a_batch",
    "scale_and_nan",
]


@pytest.mark.parametrize("name", ATTENTIONS)
def test_flash_attention_runs_in_the_host_kernel_and_matches_eager(host_rows, tmp_path, name):
    q, k, v, kwargs = _attention_case(name, torch.Generator().manual_seed(5))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    if kwargs.get("attn_mask", torch.empty(0)).dtype == torch.bool:
        # The op takes float masks; F.scaled_dot_product_attention turns a bool one into one
        # in the graph. Its logsumexp is not returned.
        def fn(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs), None

    else:

        def fn(q, k, v):
            return op(q, k, v, **kwargs)

    with torch.no_grad():
        (out, lse), text = _compiled_module(fn, (q, k, v), tmp_path)
        want, want_lse = fn(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    if lse is not None:
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert "tpuc_attention" in text


def test_flash_attention_in_xla_keeps_a_nan_row_nan(host_rows, tmp_path):
    """The XLA lowering (`TPUC_HOST_KERNELS=-rows`, and dtypes other than f32): XLA's max skips NaN,
    which once made a row of NaN scores look fully masked and come out as zeros."""
    q, k, v, kwargs = _attention_case("scale_and_nan", torch.Generator().manual_seed(5))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def fn(q, k, v):
        return op(q, k, v, **kwargs)

    host_rows.enable_host_rows(False)
    try:
        (out, lse), text = _compiled_module(fn, (q, k, v), tmp_path)
    finally:
        host_rows.enable_host_rows(True)
    want, want_lse = fn(q, k, v)
    assert want[1, 2, 7].isnan().all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert "tpuc_attention" not in text


def _views_case(name, g):
    """A function of one input whose attention reads q, k and v through views of it."""
    x = torch.randn(2, 50, 3 * 64, generator=g)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def heads(t, n=50):  # [b, n, 64] -> [b, 4, n, 16]
        return t.view(2, n, 4, 16).transpose(1, 2)

    if name == "split_heads":  # one projection split into q, k, v, then into heads (HF)
        return lambda x: op(*(heads(t) for t in x.split(64, dim=2)))[0], x
    if name == "select_heads":  # torch's MultiheadAttention: [3, s, b, e] selected, as ViT's
        y = torch.randn(50, 2, 3 * 64, generator=g)

        def fn(y):
            p = y.unflatten(-1, (3, 64)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            q, k, v = (t.view(50, 8, 16).transpose(0, 1).view(2, 4, 50, 16) for t in (p[0], p[1], p[2]))
            return op(q, k, v)[0]

        return fn, y
    if name == "one_query_row":  # a decoding step: q of one row, viewed out of its projection
        k, v = (torch.randn(2, 4, 600, 16, generator=g) for _ in range(2))
        return lambda x: op(heads(x[:, :1].split(64, dim=2)[0], 1), k, v)[0], x
    if name == "strided_columns":  # every other column: rows not contiguous, read as a copy
        return lambda x: op(*(t[..., ::2].reshape(2, 50, 2, 16).transpose(1, 2) for t in x.split(64, dim=2)))[
            0
        ], x
    if name == "keys_columns_first":  # k stored [b, h, d, s]: transposed back, so a copy

        def fn(x):
            q, k, v = (heads(t) for t in x.split(64, dim=2))
            kt = k.transpose(2, 3).contiguous() * 1.0
            return op(q, kt.transpose(2, 3), v)[0]

        return fn, x
    raise KeyError(name)


@pytest.mark.parametrize(
    "name", ["split_heads", "select_heads", "one_query_row", "strided_columns", "keys_columns_first"]
)
def test_flash_attention_reads_q_k_v_through_views_and_matches_eager(host_rows, tmp_path, name):
    """The kernel reads q, k and v where they lie in the buffer they were viewed from (through
    reshapes, transposes and slices), or a copy where their rows are not contiguous there."""
    fn, x = _views_case(name, torch.Generator().manual_seed(9))
    with torch.no_grad():
        out, text = _compiled_module(fn, (x,), tmp_path)
        torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)
    assert "tpuc_attention" in text
    if name in ("split_heads", "select_heads"):
        # XLA's optimized program hands the kernel the input itself, three times: no copies.
        (hlo,) = tmp_path.glob("*/optimized_hlo.txt")
        (call,) = (line for line in hlo.read_text().splitlines() if '"tpuc_attention"' in line)
        operands = re.search(r"custom-call\(([^)]*)\)", call).group(1).split(", ")[:3]
        assert all(o.startswith("%Arg_") for o in operands), call
