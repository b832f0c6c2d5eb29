"""The per-call hot path (issue 8): call plans, outputs lent to torch in place (and never
aliased), the general path for inputs a plan does not fit, and the per-call profile of
TPUC_LOG=debug."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DISCRETE

import tpuc
from tpuc import _native, backend, callprof, compiled_graph

# Every test here runs again under TPUC_DEBUG=discrete_device: call plans upload inputs and lend or
# copy outputs by the mode.
pytestmark = pytest.mark.discrete_device


def _capture_graphs(monkeypatch) -> list:
    graphs = []
    original = compiled_graph.CompiledGraph.__init__

    def recording(self, *a, **k):
        original(self, *a, **k)
        graphs.append(self)

    monkeypatch.setattr(compiled_graph.CompiledGraph, "__init__", recording)
    return graphs


def test_static_graph_gets_a_call_plan(monkeypatch):
    graphs = _capture_graphs(monkeypatch)
    fn = torch.compile(lambda x, y: (x * y + 1, x.sum()), backend="tpu", options={"cache_dir": None})
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    fn(x, y)
    plan = graphs[-1].fast
    assert isinstance(plan, _native.CallPlan)
    before = tpuc.stats()["executions"]
    for _ in range(3):
        a, b = fn(x, y)
        torch.testing.assert_close(a, x * y + 1)
        torch.testing.assert_close(b, x.sum())
    assert tpuc.stats()["executions"] == before + 3


def test_outputs_are_fresh_tensors_every_call():
    fn = torch.compile(lambda x: x + 1, backend="tpu", options={"cache_dir": None})
    x = torch.randn(16)
    first = fn(x)
    kept = first.clone()
    seen = {first.data_ptr()}
    for k in range(5):
        out = fn(x + k)
        torch.testing.assert_close(out, x + k + 1)
        seen.add(out.data_ptr())
    torch.testing.assert_close(first, kept)  # never overwritten by a later call
    assert out.data_ptr() != first.data_ptr()


def test_inputs_that_do_not_fit_the_plan_take_the_general_path(monkeypatch):
    graphs = _capture_graphs(monkeypatch)
    fn = torch.compile(lambda x: x * 2 + 1, backend="tpu", options={"cache_dir": None})
    x = torch.randn(6, 5)
    fn(x)
    g = graphs[-1]
    t = torch.randn(5, 6).t()  # same shape, not contiguous
    assert not t.is_contiguous()
    assert g.fast.try_call([t]) is None
    (out,) = g([t])
    torch.testing.assert_close(out, t * 2 + 1)
    # another shape or dtype than the plan's never reaches the executable through the plan
    assert g.fast.try_call([torch.randn(6, 4)]) is None
    assert g.fast.try_call([torch.randn(6, 5, dtype=torch.float64)]) is None
    assert g.fast.try_call([3]) is None  # not a tensor
    # the plan is what AOTAutograd calls: what does not fit goes to the graph's general path
    (out,) = g.fast([t])
    torch.testing.assert_close(out, t * 2 + 1)


def test_a_dropped_compiled_function_frees_its_graph(monkeypatch):
    # The static plan (what AOTAutograd holds) falls back to its graph, which holds the plan:
    # Python's GC must see that cycle (CallPlan.__traverse__) and free both.
    import weakref

    graphs = _capture_graphs(monkeypatch)
    lin = torch.nn.Linear(8, 4)
    fn = torch.compile(lin, backend="tpu", options={"cache_dir": None})
    with torch.no_grad():
        fn(torch.randn(3, 8))
    gone = weakref.ref(graphs.pop())
    assert gone() is not None
    del fn
    torch._dynamo.reset()
    gc.collect()
    assert gone() is None


def test_outputs_are_lent_in_place_and_outlive_everything():
    # On the CPU plugin an output tensor is the executable's output buffer itself (DLPack); it
    # must stay valid after the compiled function, the graph and Dynamo's caches are gone.
    def f(x, m):
        return x * 2, (x > 0) & m, x.to(torch.bfloat16) + 1, x.sum(), x.to(torch.complex64) * 2, x[:0]

    fn = torch.compile(f, backend="tpu", options={"cache_dir": None})
    x, m = torch.randn(5, 3), torch.rand(5, 3) > 0.5
    outs = [fn(x, m) for _ in range(3)]
    expected = f(x, m)
    del fn
    torch._dynamo.reset()
    gc.collect()
    for got in outs:
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape and g.is_contiguous()
            torch.testing.assert_close(g, e)
    # writable, and each call's outputs are its own memory
    outs[0][0].add_(100)
    torch.testing.assert_close(outs[1][0], x * 2)


def test_same_value_returned_twice_gives_two_tensors():
    fn = torch.compile(lambda x: (x + 1, x + 1, x), backend="tpu", options={"cache_dir": None})
    x = torch.randn(8)
    for _ in range(3):
        a, b, c = fn(x)
        a.add_(1)
        torch.testing.assert_close(b, x + 1)
        torch.testing.assert_close(a, x + 2)
        c.add_(0)  # the input passed through is not corrupted by writes to the outputs
        torch.testing.assert_close(x + 1, b)


@pytest.mark.skipif(DISCRETE, reason="outputs are lent only where device memory is host memory")
def test_lent_outputs_free_their_buffers():
    fn = torch.compile(lambda x: (x * 3, x - 1), backend="tpu", options={"cache_dir": None})
    x = torch.randn(2000)  # 8000 bytes: lent (smaller ones are copied, see below)
    for _ in range(5):
        fn(x)
    gc.collect()
    before = _native.live_objects()["buffers"]
    kept = [fn(x) for _ in range(50)]
    assert _native.live_objects()["buffers"] - before >= 100  # alive while the tensors are
    del kept
    for _ in range(200):
        fn(x)
    gc.collect()
    assert _native.live_objects()["buffers"] - before <= 2


def test_small_outputs_are_copies_that_hold_no_buffer():
    # Outputs of at most 4 KiB are copied into fresh tensors (cheaper than lending): nothing of
    # the executable's stays alive with them, and each call's outputs are its own memory.
    fn = torch.compile(lambda x: (x * 3, x - 1, x.sum()), backend="tpu", options={"cache_dir": None})
    x = torch.randn(1024)  # 4096 bytes
    for _ in range(5):
        fn(x)
    gc.collect()
    before = _native.live_objects()["buffers"]
    kept = [fn(x) for _ in range(50)]
    assert _native.live_objects()["buffers"] - before <= 2
    kept[0][0].add_(1)
    for a, b, c in kept[1:]:
        torch.testing.assert_close(a, x * 3)
        torch.testing.assert_close(b, x - 1)
        torch.testing.assert_close(c, x.sum())
        assert a.is_contiguous() and a.data_ptr() != kept[0][0].data_ptr()


def test_parameters_stay_resident_through_the_plan():
    lin = torch.nn.Linear(8, 4)
    fn = torch.compile(lin, backend="tpu", options={"cache_dir": None})
    x = torch.randn(3, 8)
    with torch.no_grad():
        fn(x)
        uploads = tpuc.stats()["device_uploads"]
        for _ in range(5):
            torch.testing.assert_close(fn(x), lin(x))
        # weight and bias (and x, the same object each call) became resident once
        assert tpuc.stats()["device_uploads"] - uploads <= 3
        lin.weight.add_(1.0)  # an in-place update re-uploads and is seen
        torch.testing.assert_close(fn(x), lin(x))


def test_execute_spin_setting_round_trips():
    old = _native.execute_spin_us()
    try:
        assert _native.execute_spin_us(0) == 0
        fn = torch.compile(lambda x: x @ x.T, backend="tpu", options={"cache_dir": None})
        x = torch.randn(64, 64)
        torch.testing.assert_close(fn(x), x @ x.T, rtol=1e-4, atol=1e-4)
        assert _native.execute_spin_us(250) == 250
        torch.testing.assert_close(fn(x), x @ x.T, rtol=1e-4, atol=1e-4)
    finally:
        _native.execute_spin_us(old)


def test_tpuc_log_debug_reports_per_call_phases():
    code = textwrap.dedent(
        """
        import torch
        from tpuc import callprof
        fn = torch.compile(lambda x: x + 1, backend="tpu", options={"cache_dir": None})
        x = torch.randn(16)
        for _ in range(10):
            torch.testing.assert_close(fn(x), x + 1)
        (prof,) = callprof.call_profiles().values()
        assert prof["calls"] == 10, prof
        assert prof["execute"] > 0, prof
        """
    )
    # Added to the debugging hooks already set (the discrete-device rerun's).
    hooks = ",".join(filter(None, [os.environ.get("TPUC_DEBUG"), "profile_every=5"]))
    env = {**os.environ, "TPUC_LOG": "debug", "TPUC_DEBUG": hooks}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "planned calls" in line]
    assert len(lines) == 3, r.stderr[-3000:]  # after call 1, 5 and 10
    for phase in callprof._PHASES:
        assert f"{phase} " in lines[-1]


def test_tpuc_log_filter_parsing():
    wants = callprof._env_wants_debug
    assert wants("debug") and wants("trace") and wants("tpuc=debug")
    assert wants("info,tpuc=debug")
    assert not wants("info") and not wants("tpuc_compiler=debug") and not wants(None)


def test_lazily_conjugated_or_negated_inputs_are_materialized():
    # conj() and the imaginary part of a conjugate are views with a conj/neg bit: their memory
    # holds the unconjugated values, so the bare data pointer would give wrong results.
    fn = torch.compile(lambda z: z * 2, backend="tpu", options={"cache_dir": None})
    z = torch.randn(4, dtype=torch.complex64)
    torch.testing.assert_close(fn(z), z * 2)
    zc = z.conj()
    assert zc.is_conj()
    for _ in range(3):  # also once it would be resident
        torch.testing.assert_close(fn(zc), zc * 2)
    g = torch.compile(lambda x: x + 1, backend="tpu", options={"cache_dir": None})
    w = torch.randn(4, dtype=torch.complex64)
    neg = w.conj().imag
    assert neg.is_neg()
    for _ in range(3):
        torch.testing.assert_close(g(neg), neg + 1)


def test_plain_inference_graphs_skip_aotautograds_runtime_wrapper():
    """Dynamo gets a plain inference graph's compiled forward itself (a static graph's call plan,
    unboxed); graphs whose wrapper has work to do (autograd, input mutations, outputs aliasing
    inputs) get AOTAutograd's wrapper, and their results stay right."""
    returned = []

    def spy(gm, example_inputs):  # the tpu backend, recording what it gives Dynamo
        compiled = backend.tpu_backend(gm, example_inputs, options={"cache_dir": None})
        returned.append(compiled)
        return compiled

    direct = (_native.Unboxed, backend._Direct)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():  # parameters require grad, autograd is off: an inference graph
        compiled = torch.compile(model, backend=spy)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x))
    assert len(returned) == 1 and isinstance(returned[0], _native.Unboxed), returned

    cases = {
        "autograd": lambda m, a: m(a),
        "input mutation": lambda m, a: m(a.mul_(2)),
        "output aliasing an input": lambda m, a: (m(a), a),
    }
    for name, fn in cases.items():
        returned.clear()
        torch._dynamo.reset()
        a, b = x.clone(), x.clone()
        got = torch.compile(fn, backend=spy)(model, a)
        want = fn(model, b)
        assert returned and not isinstance(returned[0], direct), name
        torch.testing.assert_close(got, want, msg=name)
        torch.testing.assert_close(a, b, msg=name)
        if name == "autograd":
            got.sum().backward()
            assert model[0].weight.grad is not None
        if name == "output aliasing an input":
            assert got[1] is a, name
