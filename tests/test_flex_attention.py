"""FlexAttention (`torch.nn.attention.flex_attention`): AOTAutograd keeps it as the higher-order
ops `flex_attention` / `flex_attention_backward`, which tpuc rewrites into PyTorch's own dense
implementation in ATen ops (tpuc/flex.py). Each case compares against eager, which runs that
dense implementation on the CPU, with fallback="error" so no op can run in PyTorch instead."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import tpuc

B, H, L, D = 2, 4, 16, 8

# Eager flex_attention warns that it is unfused (it materializes the scores), once per call site.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def qkv(heads_kv: int = H, length: int = L, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, length, D, generator=g)
    k = torch.randn(B, heads_kv, length, D, generator=g)
    v = torch.randn(B, heads_kv, length, D, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def compiled(fn, **kwargs):
    return torch.compile(fn, backend="tpu", options={"fallback": "error"}, **kwargs)


def check(fn, *args, **kwargs):
    expected = fn(*args)
    actual = compiled(fn, **kwargs)(*args)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["fallback_ops"] == {}
    assert tpuc.stats()["graphs_compiled"] >= 1


def causal(b, h, q, kv):
    return q >= kv


def test_plain_with_logsumexp_and_scale():
    def f(q, k, v):
        out, aux = flex_attention(q, k, v, scale=0.3, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    check(f, *qkv())


def test_causal_block_mask():
    # Blocks of 4 on 16 positions: the block mask has empty, partial and full blocks.
    mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=4)

    def f(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))

    out, aux = f(*qkv())
    got_out, got_aux = compiled(f)(*qkv())
    torch.testing.assert_close((got_out, got_aux.lse), (out, aux.lse), rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zero_and_minus_infinity_lse():
    def some_rows_empty(b, h, q, kv):
        return (q % 3 != 0) & (kv <= q)

    mask = create_block_mask(some_rows_empty, None, H, L, L, device="cpu", BLOCK_SIZE=4)

    def f(q, k, v):
        out, aux = flex_attention(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    check(f, *qkv())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mod_with_captured_relative_bias_and_alibi(dtype):
    bias = torch.randn(2 * L - 1)
    slopes = torch.rand(H)

    def rel(score, b, h, q, kv):
        return score + bias[q - kv + L - 1] - slopes[h] * (q - kv).abs()

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=rel)

    # bfloat16: scores in float32 as eager, the same rounding of the result
    check(f, *(t.to(dtype) for t in qkv()))


def test_gqa_with_mask_and_score_mod():
    mask = create_block_mask(causal, B, None, L, L, device="cpu", BLOCK_SIZE=8)

    def softcap(score, b, h, q, kv):
        return 20 * torch.tanh(score / 20)

    def f(q, k, v):
        out, aux = flex_attention(
            q, k, v, score_mod=softcap, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse

    check(f, *qkv(heads_kv=2))


def test_query_in_sequence_major_layout():
    # Models project to (B, L, H, D) and transpose: the output takes the query's strides.
    x = torch.randn(B, L, H, D)

    def f(x, k, v):
        q = x.transpose(1, 2)
        return flex_attention(q, k, v).transpose(1, 2).reshape(B, L, H * D)

    _, k, v = qkv()
    check(f, x, k, v)


def test_dynamic_length_bucketed():
    slopes = torch.rand(H)

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    def f(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=alibi, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    fn = compiled(f)
    for length in (9, 16):
        args = qkv(length=length)
        for t in args:
            torch._dynamo.mark_dynamic(t, 2, min=2, max=32)
        torch.testing.assert_close(fn(*args), f(*args), rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["xla_compiles"] == 1  # both lengths in the bucket of 16
    assert tpuc.stats()["fallback_ops"] == {}


def test_training_gradients_match_eager(monkeypatch):
    """The backward graph holds `flex_attention_backward`, rewritten into the dense backward.
    PyTorch refuses gradients through flex_attention for CPU tensors (a device check at the API;
    with CUDA tensors the same graphs reach tpuc); the check is lifted here so the CPU run can
    compare against eager, which runs the same dense backward."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    bias = torch.randn(L, L, requires_grad=True)
    mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=4)

    def rel(score, b, h, q, kv):
        return score + bias[q, kv]

    def f(q, k, v):
        out, aux = flex_attention(
            q, k, v, score_mod=rel, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse

    def grads(fn):
        q, k, v = qkv(heads_kv=2, requires_grad=True)
        bias.grad = None
        out, lse = fn(q, k, v)
        ((out * out).sum() + lse.sum()).backward()
        return out, lse, q.grad, k.grad, v.grad, bias.grad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        expected = grads(f)
        actual = grads(compiled(f))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["fallback_ops"] == {}
    assert tpuc.stats()["graphs_compiled"] == 2  # forward and backward


def test_save_and_load_compiled(tmp_path):
    # The saved graph holds the dense rewrite: loading traces nothing.
    mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=4)
    bias = torch.randn(L, L)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, q, kv: s + bias[q, kv], block_mask=mask)

    path = tmp_path / "flex.tpuc"
    options = {"cache_dir": str(tmp_path / "cache"), "fallback": "error"}
    tpuc.save_compiled(f, path, tuple(qkv()), options=options)
    loaded = tpuc.load_compiled(path)
    args = [t * 2 for t in qkv()]
    torch.testing.assert_close(loaded(*args), f(*args), rtol=1e-5, atol=1e-5)
