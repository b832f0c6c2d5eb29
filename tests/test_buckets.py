"""Bounded dynamism: dims marked with a declared maximum are padded to buckets; every real size
gives eager's results, with one XLA compile per bucket used."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import COMPILES_PER_EXECUTABLE

import tpuc

NO_CACHE = {"cache_dir": None}


def _compile(model, **options):
    return torch.compile(model, backend="tpu", options={**NO_CACHE, **options})


def _first_call(compiled, x, dim, maximum):
    """The first call carries the marks (Dynamo reads them off the tensor it traces)."""
    x = x.clone()
    torch._dynamo.mark_dynamic(x, dim, min=2, max=maximum)
    return compiled(x)


class Decoder(nn.Module):
    """Embedding, causal attention with a mask, LayerNorm, GELU MLP, mean pooling and
    log_softmax over the vocabulary."""

    def __init__(self, vocab=40, hidden=32, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.heads = heads

    def forward(self, ids):
        x = self.emb(ids)
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (y.view(b, t, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return F.log_softmax(self.head(x.mean(dim=1)), dim=-1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.flatten(1)).softmax(-1)


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))


@pytest.mark.discrete_device
def test_mlp_dynamic_batch_every_size_one_compile_per_bucket():
    torch.manual_seed(0)
    model = _mlp().eval()
    compiled = _compile(model, buckets=[4, 8])
    tpuc.reset_stats()
    with torch.no_grad():
        _first_call(compiled, torch.randn(3, 6), 0, 8)
        for n in range(2, 9):
            x = torch.randn(n, 6)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    # Buckets 4 and 8 serve sizes 2..8: two XLA compiles, no more.
    assert tpuc.stats()["xla_compiles"] == 2


@pytest.mark.stand_in
def test_decoder_dynamic_sequence_every_length():
    torch.manual_seed(0)
    model = Decoder().eval()
    compiled = _compile(model)
    tpuc.reset_stats()
    with torch.no_grad():
        _first_call(compiled, torch.randint(0, 40, (2, 5)), 1, 12)
        for t in range(2, 13):
            ids = torch.randint(0, 40, (2, t))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    # pow2 buckets capped by the maximum: 2, 4, 8, 12 (each twice through the stand-in).
    assert tpuc.stats()["xla_compiles"] == 4 * COMPILES_PER_EXECUTABLE


def test_length_one_is_exact_too():
    """PyTorch specializes size 1 (its own static graph); results still match."""
    torch.manual_seed(0)
    model = Decoder().eval()
    compiled = _compile(model)
    with torch.no_grad():
        _first_call(compiled, torch.randint(0, 40, (2, 5)), 1, 8)
        ids = torch.randint(0, 40, (2, 1))
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_convnet_dynamic_batch():
    torch.manual_seed(0)
    model = ConvNet().eval()
    model.bn.running_mean.uniform_(-0.5, 0.5)
    model.bn.running_var.uniform_(0.5, 2.0)
    compiled = _compile(model)
    tpuc.reset_stats()
    with torch.no_grad():
        _first_call(compiled, torch.randn(3, 3, 8, 8), 0, 6)
        for n in range(2, 7):
            x = torch.randn(n, 3, 8, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert tpuc.stats()["xla_compiles"] == 3  # buckets 2, 4, 6


def test_batch_and_sequence_dynamic_at_once():
    torch.manual_seed(0)
    model = Decoder().eval()
    compiled = _compile(model, buckets=[4, 8])
    first = torch.randint(0, 40, (3, 5))
    torch._dynamo.mark_dynamic(first, 0, min=2, max=4)
    torch._dynamo.mark_dynamic(first, 1, min=2, max=8)
    tpuc.reset_stats()
    with torch.no_grad():
        compiled(first)
        for b in range(2, 5):
            for t in (2, 3, 5, 8):
                ids = torch.randint(0, 40, (b, t))
                torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    # (batch bucket 4) x (sequence buckets 4, 8)
    assert tpuc.stats()["xla_compiles"] == 2


@pytest.mark.discrete_device
def test_training_step_dynamic_batch_matches_eager_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    compiled = _compile(model, buckets=[4, 8])

    def step(forward, m, x, y):
        m.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    first = torch.randn(5, 6)
    torch._dynamo.mark_dynamic(first, 0, min=2, max=8)
    step(compiled, model, first, torch.randint(0, 3, (5,)))
    tpuc.reset_stats()
    for n in range(2, 9):
        x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
        loss, grads = step(compiled, model, x, y)
        ref_loss, ref_grads = step(reference, reference, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    # Forward and backward graphs, buckets 4 and 8 (bucket 8 was compiled by the first call).
    assert tpuc.stats()["xla_compiles"] == 2


def test_size_above_maximum_names_input_dim_and_maximum():
    model = Decoder().eval()
    compiled = _compile(model)
    with torch.no_grad():
        _first_call(compiled, torch.randint(0, 40, (2, 5)), 1, 8)
        with pytest.raises(ValueError, match=r"input `ids` dim 1 has size 9, above its declared maximum 8"):
            compiled(torch.randint(0, 40, (2, 9)))


def test_last_real_position_and_negative_indices_use_the_real_size():
    class LastToken(nn.Module):
        def forward(self, x, idx):
            return x[:, -1] * 2 + x[:, idx].sum(1)  # positions counted from the real end

    model = LastToken()
    compiled = _compile(model)
    idx = torch.tensor([-1, -2, 0])
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no per-shape fallback warning
        _first_call_args = torch.randn(2, 5, 3)
        torch._dynamo.mark_dynamic(_first_call_args, 1, min=2, max=8)
        compiled(_first_call_args, idx)
        for t in (2, 3, 7, 8):
            x = torch.randn(2, t, 3)
            torch.testing.assert_close(compiled(x, idx), model(x, idx))
    assert tpuc.stats()["xla_compiles"] == 3  # buckets 2, 4, 8


def test_op_the_pass_cannot_make_exact_falls_back_to_per_shape_compiles():
    class Doubled(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], dim=1).cumsum(1)  # padding lands in the middle

    model = Doubled()
    compiled = _compile(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _first_call(compiled, torch.randn(2, 5, 3), 1, 8)
        for t in (2, 3, 7):
            x = torch.randn(2, t, 3)
            torch.testing.assert_close(compiled(x), model(x))
    messages = [str(w.message) for w in caught]
    assert any("per shape" in m and "aten.cat.default" in m for m in messages), messages


@pytest.mark.stand_in
def test_batchnorm_training_dynamic_batch_matches_eager_statistics_and_gradients():
    torch.manual_seed(0)
    model = ConvNet().train()
    reference = copy.deepcopy(model)
    compiled = _compile(model, buckets=[4, 6])

    def step(forward, m, x):
        m.zero_grad()
        loss = forward(x).square().sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    first = torch.randn(5, 3, 8, 8)
    torch._dynamo.mark_dynamic(first, 0, min=2, max=6)
    tpuc.reset_stats()
    step(compiled, model, first)
    step(reference, reference, first)
    for n in (2, 3, 5, 6):
        x = torch.randn(n, 3, 8, 8)
        loss, grads = step(compiled, model, x)
        ref_loss, ref_grads = step(reference, reference, x)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.bn.running_var, reference.bn.running_var, rtol=1e-5, atol=1e-6)
        assert model.bn.num_batches_tracked == reference.bn.num_batches_tracked
    stats = tpuc.stats()
    assert not stats["fallback_ops"], stats["fallback_ops"]
    # Forward and backward for buckets 4 and 6.
    assert stats["xla_compiles"] == 4 * COMPILES_PER_EXECUTABLE


def test_decoder_training_dynamic_sequence_is_bucketed_and_matches_eager_gradients():
    torch.manual_seed(0)
    model = Decoder().train()
    reference = copy.deepcopy(model)
    compiled = _compile(model, buckets=[4, 8])

    def step(forward, m, ids):
        m.zero_grad()
        loss = -forward(ids)[:, 0].mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    first = torch.randint(0, 40, (2, 5))
    torch._dynamo.mark_dynamic(first, 1, min=2, max=8)
    tpuc.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no per-shape fallback
        step(compiled, model, first)
        for t in range(2, 9):
            ids = torch.randint(0, 40, (2, t))
            loss, grads = step(compiled, model, ids)
            ref_loss, ref_grads = step(reference, reference, ids)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert tpuc.stats()["xla_compiles"] == 4  # forward and backward, buckets 4 and 8


def test_sizes_pinned_by_the_trace_are_not_declared_maxima():
    # Linear.forward compiled for three input widths: Dynamo's automatic dynamic makes the width
    # symbolic on the second trace, where the matmul pins it to one value ([128, 128]); that is
    # no maximum, and the third width (256) must compile, not raise.
    with torch.no_grad():
        for i, o in ((32, 128), (128, 32), (256, 8)):
            m = torch.nn.Linear(i, o)
            x = torch.randn(2, 16, i)
            torch.testing.assert_close(torch.compile(m, backend="tpu")(x), m(x))


def test_walk_finds_the_size_derived_floats_itself():
    """The FX walk finds the nodes computing a float from sizes (`SymFloat`-valued, not a
    number) and makes each a 0-d float64 input after the placeholders, in the order it returns
    them; a `Scalar` overload that took one becomes the `Tensor` overload."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpuc import fx_export

    def f(x):
        n = x.shape[0]
        return x * (n / (n - 1)) + 0.5

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5, 3))
    expected = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.SymFloat)
        and not n.meta["val"].node.expr.is_number
    ]
    assert expected, gm.graph
    *_, found = fx_export.export_cleaned(gm, enabled=[])
    assert found == expected
    walked, _, _ = fx_export.export(gm)
    assert f"%{found[0].name}: float64[] = input()" in str(walked), str(walked)
    assert "aten.mul.Tensor" in str(walked), str(walked)


@pytest.mark.discrete_device
def test_saved_input_of_a_bucketed_training_graph_is_the_callers_tensor():
    """The forward returns its (padded) input unchanged for the backward: what it saves is the
    caller's tensor at its real size, never the padded one, and the gradients are eager's."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 3))

    def f(x):
        return (x @ w).tanh().sum()

    compiled = _compile(f, buckets=[4, 8])
    first = torch.randn(5, 6)
    torch._dynamo.mark_dynamic(first, 0, min=2, max=8)
    compiled(first).backward()
    for n in (2, 3, 5, 7):
        x = torch.randn(n, 6)
        w.grad = None
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(x)
        assert any(t is x for t in saved), [tuple(t.shape) for t in saved]
        loss.backward()
        got = w.grad.clone()
        w.grad = None
        f(x).backward()
        torch.testing.assert_close(got, w.grad, rtol=1e-5, atol=1e-5)
