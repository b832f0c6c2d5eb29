"""Static-cache generation through backend="tpu" (the fast subset of bench/generate.py):
`model.generate(cache_implementation="static")` with `model.forward` compiled gives the same
greedy tokens as eager; prompts of several lengths with a declared maximum share one executable
per bucket; and the fixes the generation sweep needed, each on its own.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tpuc
from tpuc import buckets, decompositions

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import generate  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = generate.VOCAB
NEW = 12


def _lm(family: str):
    """The family's tiny model exactly as bench/generate.py builds it (its `tiny_config`)."""
    return generate.build(family)


def _generate(model, ids):
    return generate.generate(model, ids, NEW)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text"])
def test_static_cache_generate_tokens_equal_eager(family):
    model = _lm(family)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = _generate(model, ids)
    model.forward = torch.compile(model.forward, backend="tpu", options={"fallback": "error"})
    actual = _generate(model, ids)
    assert torch.equal(actual, expected)
    s = tpuc.stats()
    assert s["fallback_ops"] == {}
    assert s["executions"] == NEW  # the prefill and every decode step ran compiled


def test_prompt_lengths_share_bucketed_executables():
    """Prompts of lengths 5, 6 and 7 (bucket 8) and 11 (bucket 16) under one declared maximum:
    one prefill executable per bucket, one decode executable, tokens equal to eager's."""
    model = _lm("llama")
    model.generation_config.max_cache_len = 32 + NEW  # one cache size, so decode shapes never change
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=gen) for n in (5, 6, 7, 11)]
    expected = [_generate(model, p) for p in prompts]
    compiled = torch.compile(model.forward, backend="tpu", options={"fallback": "error", "cache_dir": None})

    def forward(*args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:
            torch._dynamo.mark_dynamic(ids, 1, min=2, max=32)
        return compiled(*args, **kwargs)

    model.forward = forward
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "compiled per shape instead of per bucket"
        for p, e in zip(prompts, expected, strict=True):
            assert torch.equal(_generate(model, p), e)
    s = tpuc.stats()
    assert s["xla_compiles"] == 3, s  # prefill buckets 8 and 16, and the decode step
    assert s["graphs_compiled"] == 2  # one symbolic prefill trace, one decode trace


def test_grouped_mm_is_decomposed():
    """transformers' opaque MoE product (`transformers::grouped_mm_fallback`, a Python loop over
    the experts) and `torch._grouped_mm` compile to static-shape ops, with empty groups and rows
    past the last group."""
    from transformers.integrations import moe  # noqa: F401 - registers the op

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 8, generator=gen)
    w = torch.randn(4, 8, 8, generator=gen)

    def f(x, w, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)

    def g(x, w, offs):
        return torch._grouped_mm(x, w, offs=offs)

    # Rows past the last group are zero in transformers' op and left unwritten by the aten kernel.
    for fn, ends in ((f, ([3, 3, 7, 9], [0, 5, 5, 10])), (g, ([3, 3, 7, 10], [0, 5, 5, 10]))):
        compiled = torch.compile(fn, backend="tpu", dynamic=False, options={"fallback": "error"})
        for offs in ends:
            offs = torch.tensor(offs, dtype=torch.int32)
            torch.testing.assert_close(compiled(x, w, offs), fn(x, w, offs), rtol=1e-6, atol=1e-6)
    assert tpuc.stats()["fallback_ops"] == {}


def test_index_put_by_select_matches_index_put():
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(2, 3, 9, 4, generator=gen)
    values = torch.randn(2, 3, 4, 4, generator=gen)
    for idx in ([0, 1, 2, 3], [5, -1, 2, 7]):
        idx = torch.tensor(idx)
        expected = torch.ops.aten.index_put.default(target, [None, None, idx], values)
        assert torch.equal(decompositions._index_put_by_select(target, [None, None, idx], values), expected)
    assert decompositions._index_put_by_select(target, [None, None, idx], values, True) is NotImplemented


def test_bucketed_cache_write_matches_eager():
    """A KV-cache-style write (`cache.index_copy_(1, positions, x)`) with the written length
    marked dynamic: every length 2..8 is exact, one executable per bucket."""

    def step(cache, x):
        pos = torch.arange(x.shape[1])
        return cache.index_copy(1, pos, x * 2).sum(-1)

    cache = torch.randn(2, 8, 3)
    compiled = torch.compile(step, backend="tpu", options={"fallback": "error", "cache_dir": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for n in range(2, 9):
            x = torch.randn(2, n, 3)
            torch._dynamo.mark_dynamic(x, 1, min=2, max=8)
            assert torch.equal(compiled(cache, x), step(cache, x))
    assert tpuc.stats()["xla_compiles"] == 3  # buckets 2, 4, 8


def test_declared_maxima_skips_integers_bounded_only_above():
    """An unbacked integer bounded above only (range [-oo, 5]) is not a declared maximum, and
    reading it does not raise (it did: int(-oo))."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    u = env.create_unbacked_symint()
    torch._check(u <= 5)
    x = mode.from_tensor(torch.zeros(3))
    assert buckets.declared_maxima([x], {"L['x'].size()[0]": 8}) == {}
