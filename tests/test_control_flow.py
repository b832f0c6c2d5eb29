"""PyTorch's control-flow operators on the device (docs/control-flow.md): `torch.cond` as
`stablehlo.if`, `while_loop`, `scan` and `map` as `stablehlo.while`, compiled with
fallback="error" (so nothing runs in PyTorch) and compared with eager, forward and backward;
nested inside each other; PyTorch's own control-flow OpInfo samples; and a TPU target's
executable with the loop in it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._higher_order_ops import associative_scan, scan, while_loop
from torch._higher_order_ops.map import map as map_fn

import tpuc
from tpuc import runtime

STRICT = {"fallback": "error"}


def compiled(fn, dump_dir=None, **options):
    opts = {**STRICT, **options}
    if dump_dir is not None:
        opts["dump_dir"] = str(dump_dir)
    return torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False, options=opts)


def modules(dump_dir) -> str:
    """Every StableHLO module dumped under `dump_dir`, joined."""
    return "\n".join(p.read_text() for p in sorted(dump_dir.glob("*/stablehlo.mlir")))


def check(fn, *args, dump_dir=None, rtol=1e-5, atol=1e-5):
    expected = fn(*args)
    actual = compiled(fn, dump_dir)(*args)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    assert tpuc.stats()["fallback_ops"] == {}
    return actual


def grads(fn, *args):
    """Gradients of sum(out**2) for the arguments that require them."""
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = fn(*args)
    out = out if isinstance(out, tuple | list) else (out,)
    sum(o.square().sum() for o in out).backward()
    return [a.grad for a in args if a.requires_grad]


def check_grads(fn, *args, rtol=1e-4, atol=1e-4):
    got = grads(compiled(fn), *args)
    want = grads(fn, *args)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    assert tpuc.stats()["fallback_ops"] == {}


# cond


def branchy(x, w):
    return torch.cond(
        x.sum() > 0, lambda x, w: ((x @ w).sin(), x + 1), lambda x, w: (x.cos() * 2, x - w), (x, w)
    )


@pytest.mark.parametrize("sign", [1, -1])
def test_cond_runs_the_branch_the_data_picks_as_stablehlo_if(sign, tmp_path):
    x = torch.randn(64, 64).abs() * sign
    w = torch.randn(64, 64) / 8
    check(branchy, x, w, dump_dir=tmp_path)
    text = modules(tmp_path)
    assert text.count('"stablehlo.if"') == 1, text


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3,), (5, 70)])
def test_cond_over_dtypes_and_shapes(dtype, shape):
    def f(x, y):
        return torch.cond((x > y).any(), lambda x, y: x * 2 - y, lambda x, y: x + y, (x, y))

    if dtype.is_floating_point:
        x, y = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    else:
        x, y = torch.randint(-9, 9, shape, dtype=dtype), torch.randint(-9, 9, shape, dtype=dtype)
    check(f, x, y)
    check(f, y - 100, y)  # the other branch


def test_cond_with_a_captured_tensor_and_a_branch_returning_its_input():
    bias = torch.randn(64)

    def f(x):
        return torch.cond(x.mean() > 0, lambda x: x.clone(), lambda x: torch.relu(x + bias), (x,))

    for shift in (3.0, -3.0):
        check(f, torch.randn(8, 64) + shift)


# while_loop


def test_while_loop_counts_on_the_device(tmp_path):
    def f(x):
        i = torch.tensor(0)
        return while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (i, x))

    check(f, torch.randn(64, 65), dump_dir=tmp_path)
    assert '"stablehlo.while"' in modules(tmp_path)


def test_while_loop_with_a_data_dependent_trip_count_and_captured_inputs():
    w = torch.randn(64, 64) / 16

    def f(x, limit):
        # Runs until the norm passes `limit`: how many steps only the data says.
        def cond(n, x):
            return (x.norm() < limit) & (n < 100)

        def body(n, x):
            return n + 1, x @ w + x

        return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), x))

    x = torch.randn(4, 64)
    for limit in (10.0, 1e3, 1e5):
        check(f, x, torch.tensor(limit), rtol=1e-4, atol=1e-4)


def test_while_loop_over_integers():
    def f(a, b):
        # Euclid's algorithm, elementwise, until every pair is done.
        return while_loop(
            lambda a, b: (b != 0).any(),
            lambda a, b: (b.clone(), torch.where(b != 0, a % b.clamp(min=1), 0)),
            (a, b),
        )

    a = torch.randint(1, 1000, (64,))
    b = torch.randint(1, 1000, (64,))
    check(f, a, b)


# scan


def rnn(h0, xs, w, u):
    def step(h, x):
        h = torch.tanh(h @ w + x @ u)
        return h, h.sum(-1)

    return scan(step, h0, xs)


def test_scan_an_rnn_cell_over_12_steps_as_one_while_loop(tmp_path):
    h0, xs = torch.randn(4, 64), torch.randn(12, 4, 32)
    w, u = torch.randn(64, 64) / 8, torch.randn(32, 64) / 8
    check(rnn, h0, xs, w, u, dump_dir=tmp_path, rtol=1e-4, atol=1e-4)
    text = modules(tmp_path)
    assert text.count('"stablehlo.while"') == 1, text
    assert '"stablehlo.dynamic_slice"' in text and '"stablehlo.dynamic_update_slice"' in text


def test_scan_over_8_stacked_layer_weights():
    layers, dim = 8, 64
    ws = torch.randn(layers, dim, dim) / 8
    bs = torch.randn(layers, dim)

    def stack(x, ws, bs):
        def layer(x, wb):
            w, b = wb
            y = torch.nn.functional.gelu(x @ w + b) + x
            return y, y.mean()

        return scan(layer, x, (ws, bs))

    check(stack, torch.randn(16, dim), ws, bs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_scan_cumulative_products_and_reverse(dtype):
    xs = torch.randint(-3, 4, (10, 7), dtype=dtype) if not dtype.is_floating_point else torch.randn(10, 70)

    def f(xs):
        init = torch.ones_like(xs[0])
        fwd = scan(lambda c, x: (c * x + 1, c.clone()), init, xs)
        back = scan(lambda c, x: (c + x, c * 2), init, xs, reverse=True)
        return fwd, back

    check(f, xs)


# map


@pytest.mark.parametrize("shape", [(3, 64), (9, 4, 70)])
def test_map_over_the_leading_dim(shape, tmp_path):
    xs, y = torch.randn(shape), torch.randn(shape[1:])

    def f(xs, y):
        return map_fn(lambda x, y: (x * y + 1).softmax(-1), xs, y)

    check(f, xs, y, dump_dir=tmp_path)
    assert '"stablehlo.while"' in modules(tmp_path)


def test_map_over_integers():
    def f(xs):
        return map_fn(lambda x: x.cumsum(0) * 3 - 1, xs)

    check(f, torch.randint(-50, 50, (6, 65)))


# nesting, associative_scan


def test_a_cond_inside_a_scan_body(tmp_path):
    def f(h0, xs, w):
        def step(h, x):
            h = torch.cond(x.sum() > 0, lambda h, x: torch.tanh(h @ w + x), lambda h, x: h * 0.5 - x, (h, x))
            return h, h.amax(-1)

        return scan(step, h0, xs)

    check(
        f,
        torch.randn(4, 64),
        torch.randn(12, 4, 64),
        torch.randn(64, 64) / 8,
        dump_dir=tmp_path,
        rtol=1e-4,
        atol=1e-4,
    )
    text = modules(tmp_path)
    assert '"stablehlo.while"' in text and '"stablehlo.if"' in text


def test_a_map_inside_a_while_loop():
    def f(x):
        def body(i, x):
            return i + 1, map_fn(lambda r: r.sin() + i, x)

        return while_loop(lambda i, x: i < 3, body, (torch.zeros((), dtype=torch.int64), x))

    check(f, torch.randn(5, 64))


def test_associative_scan_compiles_as_plain_ops():
    def f(x):
        return associative_scan(lambda a, b: a + b, x, dim=0, combine_mode="generic")

    x = torch.randn(16, 64)
    check(f, x, rtol=1e-4, atol=1e-4)


# backward


def test_cond_backward_matches_eager():
    w = (torch.randn(64, 64) / 8).requires_grad_()
    for sign in (1, -1):
        x = (torch.randn(64, 64).abs() * sign).requires_grad_()
        check_grads(lambda x, w: branchy(x, w)[0] + branchy(x, w)[1], x, w)


def test_scan_backward_matches_eager():
    h0 = torch.randn(4, 64, requires_grad=True)
    xs = torch.randn(12, 4, 32, requires_grad=True)
    w = (torch.randn(64, 64) / 8).requires_grad_()
    u = (torch.randn(32, 64) / 8).requires_grad_()
    check_grads(rnn, h0, xs, w, u)


def test_map_backward_matches_eager():
    xs = torch.randn(6, 64, requires_grad=True)
    y = torch.randn(64, requires_grad=True)
    check_grads(lambda xs, y: map_fn(lambda x, y: (x * y).sin(), xs, y), xs, y)


# PyTorch's own samples


def _hop_samples():
    try:
        from torch.testing._internal.hop_db import hop_db
    except ImportError:
        return []
    # Not while_loop_stack_output: its outputs have as many rows as the loop runs steps, a
    # size only the data knows (tpuc compiles static shapes).
    wanted = {"cond", "while_loop", "scan", "map"}
    return [pytest.param(op, id=f"{op.name}-{op.variant_test_name}") for op in hop_db if op.name in wanted]


@pytest.mark.parametrize("op", _hop_samples())
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_pytorchs_control_flow_opinfo_samples(op, dtype):
    if op.name == "while_loop" and not dtype.is_floating_point:
        pytest.skip("the sample's body turns integers into floats, which PyTorch itself refuses")
    for sample in op.sample_inputs("cpu", dtype, requires_grad=False):
        args = (sample.input, *sample.args)
        torch._dynamo.reset()

        def f(*args, op=op, kwargs=sample.kwargs):
            return op.op(*args, **kwargs)

        check(f, *args)


# what is refused


# bucketed dynamic dims (declared maxima): one executable per bucket, exact at every real size

W8 = torch.randn(8, 8) * 0.3


def _bucket_cases():
    rows = lambda n: (torch.randn(n, 8),)  # noqa: E731
    steps = lambda n: (torch.randn(6, n, 8), torch.randn(n, 8))  # noqa: E731
    return {
        # no mask needed inside: the padded rows only flow through
        "scan_rnn": (lambda xs, h: scan(lambda c, x: (torch.tanh(c @ W8 + x), c.sum(-1)), h, xs), steps),
        "map": (lambda x: map_fn(lambda r: torch.relu(r @ W8), x.expand(3, -1, -1)), rows),
        # masks inside the bodies read the real size, passed in as an extra operand
        "scan_sum_over_rows": (lambda xs, h: scan(lambda c, x: (c + x, c.sum(0)), h, xs), steps),
        "cond_mean": (
            lambda x: torch.cond(
                x.mean() > 0, lambda x: x.sin() - x.mean(0), lambda x: x.softmax(0) @ W8, (x,)
            ),
            rows,
        ),
        "while_loop_until_large": (
            lambda x: while_loop(
                lambda i, h: h.abs().sum() < 1e4,
                lambda i, h: (i + 1, h * 1.7 + h.mean(0)),
                (torch.tensor(0), x),
            )[1],
            rows,
        ),
        "cond_in_scan": (
            lambda xs, h: scan(
                lambda c, x: (
                    torch.cond(x.sum() > 0, lambda c, x: c + x.mean(0), lambda c, x: c - x, (c, x)),
                    c.sum(0),
                ),
                h,
                xs,
            ),
            steps,
        ),
    }


@pytest.mark.parametrize("case", list(_bucket_cases()))
def test_bucketed_dims_flow_through_control_flow(case, tmp_path):
    # Rows 5 and 7 share the bucket of 8, 12 is in the bucket of 16: two executables, each
    # exact at every real size, with no warning that the graph went per shape.
    f, make = _bucket_cases()[case]
    fn = torch.compile(f, backend="tpu", fullgraph=True, options={**STRICT, "cache_dir": str(tmp_path)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (5, 7, 12):
            args = make(n)
            torch._dynamo.mark_dynamic(args[-1], 0, min=2, max=16)
            if len(args) == 2:
                torch._dynamo.mark_dynamic(args[0], 1, min=2, max=16)
            torch.testing.assert_close(fn(*args), f(*args), rtol=1e-4, atol=1e-5)
    assert tpuc.stats()["xla_compiles"] == 2


def test_a_bucketed_scan_trains(tmp_path):
    # The backward's reverse scan (a flip of xs, a contraction over the padded rows for the
    # weight's gradient) is bucketed too: forward and backward, one executable each per bucket.
    w = (torch.randn(8, 8) * 0.3).requires_grad_()

    def f(xs, h, w):
        return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), h, xs)

    fn = torch.compile(f, backend="tpu", fullgraph=True, options={**STRICT, "cache_dir": str(tmp_path)})
    for n in (5, 7, 12):
        xs, h = torch.randn(6, n, 8), torch.randn(n, 8)
        torch._dynamo.mark_dynamic(xs, 1, min=2, max=16)
        torch._dynamo.mark_dynamic(h, 0, min=2, max=16)
        got, want = (torch.autograd.grad(sum(o.square().sum() for o in g(xs, h, w)), w)[0] for g in (fn, f))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["xla_compiles"] == 4


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_a_bucketed_number_of_steps(reverse, tmp_path):
    # A sequence of 5, 7 or 12 steps in buckets of 8 and 16: the loop stops at the real number
    # of steps (a runtime trip count); a reverse scan flips the real steps only; the backward's
    # reverse scan too. Outputs and the weight's gradient equal eager's.
    w = (torch.randn(8, 8) * 0.3).requires_grad_()

    def f(xs, h, w):
        return scan(lambda c, x: (torch.tanh(c @ w + x), c * 2), h, xs, reverse=reverse)

    fn = torch.compile(f, backend="tpu", fullgraph=True, options={**STRICT, "cache_dir": str(tmp_path)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (5, 7, 12):
            xs, h = torch.randn(n, 4, 8), torch.randn(4, 8)
            torch._dynamo.mark_dynamic(xs, 0, min=2, max=16)
            got, want = fn(xs, h, w), f(xs, h, w)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            gg, gw = (torch.autograd.grad(sum(o.square().sum() for o in out), w)[0] for out in (got, want))
            torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["xla_compiles"] == 4


MESH_4 = {"shape": [4], "axes": ["data"]}
MESH_2X2 = {"shape": [2, 2], "axes": ["data", "model"]}


def _rnn(xs, w):
    return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), xs[0], xs)


def _branchy(x, w):
    y = torch.cond(x.sum() > 0, lambda x, w: torch.relu(x @ w), lambda x, w: (x - 1) @ w.t(), (x, w))
    return map_fn(lambda r, w: torch.sin(r @ w), y, w)


def _counted(x, w):
    def body(i, h):
        return i + 1, torch.tanh(h @ w)

    return while_loop(lambda i, h: i < 5, body, (torch.tensor(0), x))[1]


# XLA's SPMD partitioner takes the loops and branches as they are: the mesh's layouts are set on
# main's arguments and results, and it propagates them into the bodies.
@pytest.mark.parametrize("mesh", [MESH_4, MESH_2X2], ids=["4", "2x2"])
@pytest.mark.parametrize("sharding", ["replicated", "data_parallel", "fsdp", "tensor_parallel"])
@pytest.mark.parametrize("fn", [_rnn, _branchy, _counted], ids=["scan", "cond_map", "while_loop"])
def test_control_flow_on_a_mesh_matches_eager(fn, sharding, mesh):
    if sharding == "tensor_parallel" and mesh is MESH_4:
        mesh = {"shape": [4], "axes": ["model"]}
    torch.manual_seed(0)
    x, w = torch.randn(8, 8, 64) * 0.5, torch.randn(64, 64) * 0.1
    if fn is not _rnn:
        x = x[0]
    for sign in (1, -1):
        out = compiled(fn, mesh=mesh, sharding=sharding)(sign * x, w)
        torch.testing.assert_close(out, fn(sign * x, w), rtol=1e-4, atol=1e-5)
    assert tpuc.stats()["fallback_ops"] == {}


def test_a_scan_trains_on_a_mesh():
    # The backward's reverse scan is partitioned too: parameter gradients equal eager's.
    torch.manual_seed(0)
    xs, w = torch.randn(8, 8, 64), (torch.randn(64, 64) * 0.1).requires_grad_()
    got = grads(compiled(_rnn, mesh=MESH_4, sharding="data_parallel"), xs, w)
    want = grads(_rnn, xs, w)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert tpuc.stats()["fallback_ops"] == {}


def test_a_cond_next_to_an_op_that_runs_in_pytorch_stays_in_its_partition():
    # aten.mode has no rule: with fallback="eager" it runs in PyTorch, and the cond (with its
    # branches) is compiled in the partition around it.
    def f(x):
        y = torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))
        return torch.mode(y, -1).values + y.sum(-1)

    x = torch.randn(8, 64)
    with pytest.warns(UserWarning, match="aten.mode"):
        out = torch.compile(f, backend="tpu", fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))
    assert tpuc.stats()["fallback_ops"] == {"aten.mode.default": 1}


def test_topk_indices_that_could_tie_inside_a_body_run_in_pytorch():
    # Outside control flow a tie check reruns the graph in PyTorch; a loop body cannot be
    # rerun alone, so the whole map stays PyTorch's (its indices among ties are eager's).
    def f(xs):
        return map_fn(lambda x: torch.topk(x, 3).indices, xs)

    xs = torch.tensor([[1.0, 1, 1, 1, 2, 2], [3, 3, 3, 0, 0, 0]])
    with pytest.raises(tpuc.UnsupportedOpError, match="could tie.*topk"):
        compiled(f)(xs)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="map_impl"):
        out = torch.compile(f, backend="tpu", fullgraph=True)(xs)
    assert torch.equal(out, f(xs))


def test_symbolic_sizes_are_specialized_inside_the_bodies():
    def f(xs, h):
        return scan(lambda c, x: (c + x.sin(), c * 2), h, xs)

    fn = torch.compile(f, backend="tpu", fullgraph=True, dynamic=True, options=STRICT)
    for n in (5, 7):
        xs, h = torch.randn(n, 3, n + 1), torch.randn(3, n + 1)
        torch.testing.assert_close(fn(xs, h), f(xs, h))
    assert tpuc.stats()["fallback_ops"] == {}


# a TPU target


@pytest.mark.skipif(runtime._installed_plugin("tpu") is None, reason="libtpu is not installed")
def test_the_loops_and_branches_lower_for_a_tpu_target(tmp_path):
    def f(h0, xs, w):
        def step(h, x):
            h = torch.cond(x.sum() > 0, lambda h, x: torch.tanh(h @ w + x), lambda h, x: h - x, (h, x))
            return h, h.sum(-1)

        return scan(step, h0, xs)

    args = (torch.randn(8, 128), torch.randn(12, 8, 128), torch.randn(128, 128))
    torch._dynamo.reset()
    tpuc.precompile(
        f,
        args,
        options={
            "target": "tpu:v5e:2x2",
            "cache_dir": str(tmp_path / "cache"),
            "dump_dir": str(tmp_path / "dump"),
            **STRICT,
        },
    )
    text = modules(tmp_path / "dump")
    assert text.count('"stablehlo.while"') == 1 and text.count('"stablehlo.if"') == 1, text


@pytest.mark.skipif(runtime._installed_plugin("tpu") is None, reason="libtpu is not installed")
def test_a_scan_on_a_mesh_lowers_for_a_tpu_target(tmp_path):
    # fsdp over the 4 chips of a v5e:2x2: the weight is split, the loop partitioned by XLA.
    torch._dynamo.reset()
    tpuc.precompile(
        _rnn,
        (torch.randn(12, 8, 128), torch.randn(128, 128)),
        options={
            "target": "tpu:v5e:2x2",
            "mesh": MESH_4,
            "sharding": "fsdp",
            "cache_dir": str(tmp_path / "cache"),
            "dump_dir": str(tmp_path / "dump"),
            **STRICT,
        },
    )
    text = modules(tmp_path / "dump")
    assert text.count('"stablehlo.while"') == 1 and "mhlo.sharding" in text, text
