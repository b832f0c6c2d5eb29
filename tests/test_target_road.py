"""The TPU target on the one road (road.py, prepare.py): buckets, mutations, saved files, and
the CPU stand-in (`options={"target": ..., "stand_in": "cpu"}`) that runs the very graphs the
target's executables were compiled from, lowered by the target's rules, so that every check
here is against eager PyTorch."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import models
import pytest
import torch
import zoo
from torch import nn

import tpuc
from tpuc import _native, prepare, runtime

pytestmark = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None,
    reason="libtpu is not installed (scripts/setup.sh installs it; offline machines skip these)",
)

V5E = "tpu:v5e:2x2"
TESTS = Path(__file__).resolve().parent


def _stand_in(cache) -> dict:
    return {"target": V5E, "stand_in": "cpu", "cache_dir": str(cache)}


def _entries(cache: Path) -> dict[str, str]:
    """{key: what it was compiled for ("tpu:v5e:2x2" or "cpu")} of every cache entry."""
    keys = [p.name.removesuffix(".tpuc") for p in cache.glob("*.tpuc")]
    return {k: _native.cache_entry_target(str(cache), k) for k in keys}


def test_gpt2_buckets_on_the_target_one_executable_per_bucket_and_eager_results(tmp_path):
    """A 2-layer GPT-2 with a declared maximum of 64 tokens, called at 7 lengths from 5 to 64:
    each result is eager's (run by the stand-in), and the target's executables are one per pow2
    bucket touched (8, 16, 32, 64), not one per length."""
    model, (ids,) = zoo.make("gpt2")
    torch._dynamo.reset()
    tpuc.reset_stats()
    compiled = torch.compile(model, backend="tpu", options=_stand_in(tmp_path))
    lengths = (5, 8, 12, 20, 33, 50, 64)  # buckets 8, 16, 32, 64
    for k, n in enumerate(lengths):
        x = torch.randint(0, zoo.VOCAB, (2, n))
        if k == 0:
            torch._dynamo.mark_dynamic(x, 1, min=2, max=64)
        with torch.no_grad():
            got, want = compiled(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"length {n}")
    on_target = [k for k, t in _entries(tmp_path).items() if t == V5E]
    assert len(on_target) == 4, _entries(tmp_path)
    assert tpuc.stats()["graphs_compiled"] == 2  # the target's graph and the stand-in's: one trace


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _train(model, forward, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()


def test_batchnorm_training_on_the_target_matches_eager_statistics_and_parameters(tmp_path):
    """Three training steps of a CNN with BatchNorm through the target's road: the running
    statistics the graph writes into its buffers (mutations) and the parameters after SGD are
    eager's."""
    torch.manual_seed(0)
    model = _BatchNormNet().train()
    ref = _BatchNormNet().train()
    ref.load_state_dict(model.state_dict())
    batches = [(torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))) for _ in range(3)]
    torch._dynamo.reset()
    _train(model, torch.compile(model, backend="tpu", options=_stand_in(tmp_path)), batches)
    _train(ref, ref, batches)
    got, want = model.state_dict(), ref.state_dict()
    assert int(got["bn.num_batches_tracked"]) == 3
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    assert any(t == V5E for t in _entries(tmp_path).values())


_CHILD = textwrap.dedent(
    """
    import json, sys, torch, tpuc
    from tpuc import backend
    sys.path.insert(0, sys.argv[3])
    import models
    calls = []
    _compile = backend._compile
    backend._compile = lambda *a, **k: (calls.append(1), _compile(*a, **k))[1]
    model, (x,) = models.make("preln", seed=1)  # other weights: inputs, read from this model
    if torch.get_float32_matmul_precision() != sys.argv[4]:  # the saving process's (a guard)
        torch.set_float32_matmul_precision(sys.argv[4])
    # Guarded too, and not restored by the above: a process that set "high" and then "highest"
    # again has "ieee" where a fresh one has "none".
    if torch.backends.cuda.matmul.fp32_precision != sys.argv[5]:
        torch.backends.cuda.matmul.fp32_precision = sys.argv[5]
    fn = tpuc.load_compiled(sys.argv[1], model, options={"stand_in": "cpu", "cache_dir": sys.argv[2]})
    with torch.no_grad():
        err = (fn(x) - model(x)).abs().max().item()
    print(json.dumps({"backend_calls": len(calls), "err": err, "stats": tpuc.stats()}))
    """
)


def test_a_file_saved_for_the_target_loads_and_runs_through_the_stand_in_in_a_new_process(tmp_path):
    """`save_compiled` with a target writes one file holding the target's executables: a new
    process with an empty cache loads it (no Dynamo trace, the TPU executable from the file,
    not compiled) and runs it through the stand-in, matching eager."""
    model, (x,) = models.make("preln")
    path = tmp_path / "model.tpuc"
    torch._dynamo.reset()
    with torch.no_grad():  # an inference graph: one executable (the loader calls it so too)
        tpuc.save_compiled(model, path, (x,), options={"target": V5E, "cache_dir": str(tmp_path / "a")})
    saved = sorted(k for k, t in _entries(tmp_path / "a").items() if t == V5E)
    assert len(saved) == 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUC_")}
    cache = tmp_path / "b"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(path),
            str(cache),
            str(TESTS),
            torch.get_float32_matmul_precision(),
            torch.backends.cuda.matmul.fp32_precision,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend_calls"] == 0, out
    assert out["err"] < 1e-5, out
    # The target's executable came from the file (a disk hit), under the key it was saved with.
    assert sorted(k for k, t in _entries(cache).items() if t == V5E) == saved
    assert out["stats"]["cache_hits_disk"] == 1, out
    assert out["stats"]["xla_compiles"] == 1, out  # the stand-in's CPU executable only


def test_the_preparation_table_names_each_step_once_and_each_is_a_pass_switch():
    names = [name for name, _when, _doc in prepare.table()]
    assert len(names) == len(set(names)) and names[0] == "flex_attention"
    assert set(names) <= set(tpuc.options.pass_names())


def test_stand_in_without_a_target_is_refused():
    with pytest.raises(ValueError, match="needs option 'target'"):
        tpuc.options.parse({"stand_in": "cpu"})


def test_checks_and_ties_on_the_target_road(tmp_path):
    """A runtime check (`_assert_async`, hoisted out of the target's graph and checked on the
    host) raises as eager does, and a topk with ties returns PyTorch's indices (the tie check
    reruns the call in PyTorch), through the stand-in."""

    def f(x):
        torch._assert_async(x.sum() > 0, "sum must be positive")
        return torch.topk(x, 2, dim=1)

    torch._dynamo.reset()
    fn = torch.compile(f, backend="tpu", dynamic=False, options=_stand_in(tmp_path))
    x = torch.cat([torch.full((2, 8), 0.5), torch.randint(0, 3, (3, 8)).float()])
    tpuc.reset_stats()
    with pytest.warns(UserWarning, match="tied values"):
        got = fn(x)
    want = f(x)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    assert tpuc.stats()["eager_reruns"] == 1
    with pytest.raises(RuntimeError, match="sum must be positive"):
        fn(-x - 1)
    assert any(t == V5E for t in _entries(tmp_path).values())


def _module_without_locations(folder: Path) -> str:
    text = (folder / "stablehlo.mlir").read_text()
    return re.sub(
        r" loc\([^()]*(\([^()]*\))?[^()]*\)",
        "",
        "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#loc")),
    )


def test_the_stand_in_runs_the_very_module_the_target_compiles(tmp_path):
    """The stand-in's module is the target's (the same StableHLO, locations aside): the
    target's lowering rules, no CPU host kernels (a product and a layer norm large enough for
    them on the CPU road), and its results are eager's."""
    model = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512)).eval()
    x = torch.randn(64, 512)
    torch._dynamo.reset()
    options = {"target": V5E, "stand_in": "cpu", "cache_dir": None, "dump_dir": str(tmp_path)}
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="tpu", options=options)(x), model(x))
    dumps = {json.loads((f / "meta.json").read_text()).get("target"): f for f in tmp_path.iterdir()}
    assert set(dumps) == {V5E, None}, dumps  # the target's executable, and the stand-in's
    target, here = (_module_without_locations(dumps[k]) for k in (V5E, None))
    assert here == target
    assert "tpuc_" not in here and "stablehlo.composite" not in here
