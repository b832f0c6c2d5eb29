"""The IR pass pipeline end to end: zoo models match eager with every pass on and with each pass
off, `options["passes"]` is validated, and per-pass statistics reach `tpuc.stats()`."""

from __future__ import annotations

import pytest
import torch
import zoo

import tpuc
from tpuc import _native, options

TOL = dict(rtol=1e-5, atol=1e-5)
PIPELINE = [name for name, _group, _doc in _native.FxGraph.passes()]
MODELS = ["gpt2", "llama"]


def _run(name: str, passes: dict) -> torch.Tensor:
    torch._dynamo.reset()
    model, inputs = zoo.make(name)
    with torch.no_grad():
        expected = model(*inputs)
        compiled = torch.compile(
            model, backend="tpu", dynamic=False, options={"fallback": "error", "passes": passes}
        )
        actual = compiled(*inputs)
    torch.testing.assert_close(actual, expected, **TOL)
    return actual


CLEANUP = ["fold_constants", "fold_views", "cse", "dce"]
FUSION = ["fold_transposes", "composites"]


def test_pipeline_order_is_fixed_cleanup_then_fusion():
    assert PIPELINE == CLEANUP + FUSION
    groups = {name: group for name, group, _doc in _native.FxGraph.passes()}
    assert all(groups[n] == "cleanup" for n in CLEANUP)
    assert all(groups[n] == "fusion" for n in FUSION)


@pytest.mark.parametrize("name", MODELS)
def test_all_passes_on_matches_eager_and_shrinks_the_graph(name):
    tpuc.reset_stats()
    _run(name, {})
    s = tpuc.stats()["passes"]
    assert list(s) == PIPELINE
    for p in s.values():
        assert p["runs"] == 1 and p["seconds"] >= 0
        assert p["ops_removed"] == p["ops_before"] - p["ops_after"] >= 0
    # Every model of the zoo has view chains and repeated index arithmetic to clean up.
    assert s["fold_views"]["ops_removed"] > 0 and s["cse"]["ops_removed"] > 0
    assert s["dce"]["ops_after"] < s["fold_constants"]["ops_before"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("off", [*PIPELINE, "cleanup", "fusion"])
def test_each_pass_off_matches_eager(name, off):
    tpuc.reset_stats()
    _run(name, {off: False})
    ran = set(tpuc.stats()["passes"])
    if off == "cleanup":
        assert ran == set(FUSION)
    elif off == "fusion":
        assert ran == set(CLEANUP)
    else:
        assert ran == set(PIPELINE) - {off}


@pytest.mark.parametrize("name", ["bert", "t5", "vit"])
def test_fusion_off_matches_eager(name):
    # test_zoo runs every zoo model with all passes on; this is the other side for the
    # encoder models (the decoders are covered pass by pass above).
    tpuc.reset_stats()
    _run(name, {"fusion": False})
    assert set(tpuc.stats()["passes"]) == set(CLEANUP)


def _module(model, inputs, passes) -> str:
    """The StableHLO tpuc sends to PJRT for `model` (one graph), checked against eager."""
    from tpuc import compiled_graph

    torch._dynamo.reset()
    mlir = []
    real = compiled_graph.record_compile
    compiled_graph.record_compile = lambda exe: (mlir.append(exe.mlir), real(exe))
    try:
        compiled = torch.compile(
            model, backend="tpu", dynamic=False, options={"cache_dir": None, "passes": passes}
        )
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), **TOL)
    finally:
        compiled_graph.record_compile = real
    (text,) = mlir
    return text


def test_fold_transposes_leaves_no_transpose_for_linear_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False))
    x = torch.randn(5, 4)
    on = _module(model, (x,), {"composites": False})
    off = _module(model, (x,), {"composites": False, "fold_transposes": False})
    assert '"stablehlo.transpose"' not in on
    assert off.count('"stablehlo.transpose"') == 2
    assert on.count('"stablehlo.dot_general"') == 2


def test_composites_share_one_decomposition_per_distinct_unit():
    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)
    ]
    model = torch.nn.Sequential(*layers).eval()
    x = torch.randn(2, 5, 8)
    on = _module(model, (x,), {})
    off = _module(model, (x,), {"composites": False})
    assert on.count('"stablehlo.composite"') == 6 and '"stablehlo.composite"' not in off
    # three layers, one function per kind of unit
    assert on.count('sym_name = "tpuc.layer_norm.0"') == 1 and "tpuc.layer_norm.1" not in on
    assert on.count('sym_name = "tpuc.gelu.0"') == 1 and "tpuc.gelu.1" not in on
    assert on.count("func.func") == 3


def test_a_pass_name_overrides_its_group():
    o = options.parse({"passes": {"cleanup": False, "cse": True}})
    assert o.enabled_passes() == ["cse", *FUSION]
    o = options.parse({"passes": {"dce": False}})
    assert o.enabled_passes() == ["fold_constants", "fold_views", "cse", *FUSION]
    assert options.parse({}).enabled_passes() == PIPELINE
    assert options.parse({"passes": {"fusion": False}}).enabled_passes() == CLEANUP
    assert options.parse({"passes": {"fusion": False, "composites": True}}).enabled_passes() == [
        *CLEANUP,
        "composites",
    ]


@pytest.mark.parametrize(
    "bad",
    [{"cse": 1}, {"no_such_pass": False}, ["cse"], {"cleanup": "off"}],
)
def test_bad_passes_option_raises_naming_the_valid_names(bad):
    with pytest.raises(ValueError) as e:
        options.parse({"passes": bad})
    msg = str(e.value)
    for valid in ("cleanup", "fusion", *PIPELINE):
        assert valid in msg, msg


def test_bad_passes_option_raises_through_torch_compile():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="tpu", options={"passes": {"constant_folding": False}})
    with pytest.raises(Exception, match="valid names are: cleanup, fusion, fold_constants"):
        compiled(torch.randn(2, 4))


def test_dump_meta_has_per_pass_stats(tmp_path):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    compiled = torch.compile(model, backend="tpu", options={"dump_dir": str(tmp_path), "cache_dir": None})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    import json

    (meta_file,) = tmp_path.glob("*/meta.json")
    meta = json.loads(meta_file.read_text())
    assert [p["pass"] for p in meta["passes"]] == PIPELINE
    for p in meta["passes"]:
        assert {"ops_before", "ops_after", "changes", "seconds", "op_counts_after"} <= set(p)
