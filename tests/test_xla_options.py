"""XLA debug options per compile on the CPU plugin (`CompileOptions.xla_options`, sent as
`env_option_overrides`): XLA:CPU's YNNPACK fusions on (the default, `CPU_YNN_FUSION_TYPES` in
compiler/src/pipeline.rs) or off (`tpuc._native.set_cpu_ynn_fusion_types("")`). The options are
part of the executable's cache key, so an executable compiled one way is never reused the other
way, not even through AOTAutograd's cache (whose entry does not cover them); results match eager
both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tpuc
from tpuc import _native


def _step(x, w, b):
    # A product and row reductions (softmax, layer norm): what XLA:CPU hands YNNPACK.
    h = torch.softmax(x @ w + b, dim=-1)
    return torch.nn.functional.layer_norm(h, (h.shape[-1],)) + h.amax(-1, keepdim=True)


def _compile_and_run(args, cache: Path, dump: Path):
    fn = torch.compile(_step, backend="tpu", options={"cache_dir": str(cache), "dump_dir": str(dump)})
    before = tpuc.stats()["xla_compiles"]
    out = fn(*args)
    (meta,) = dump.rglob("meta.json")
    hlo = (meta.parent / "optimized_hlo.txt").read_text()
    return out, json.loads(meta.read_text())["cache_key"], tpuc.stats()["xla_compiles"] - before, hlo


def _makes_ynn_fusions() -> bool:
    """Whether the default CPU plugin is the newer XLA build, which makes YNNPACK fusions (the
    older fallback, xla-cpu-pjrt, makes none by default)."""
    return "lammps_jax_pjrt_cpu" in str(tpuc.runtime.resolve_plugin(None))


@pytest.fixture
def restore_ynn():
    previous = _native.set_cpu_ynn_fusion_types(None)
    yield
    _native.set_cpu_ynn_fusion_types(previous)


def test_ynn_fusions_off_is_another_executable_with_the_same_results(tmp_path, restore_ynn):
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(64, 256, generator=g),
        torch.randn(256, 256, generator=g) / 16,
        torch.randn(256, generator=g),
    )
    expected = _step(*args)
    cache = tmp_path / "cache"
    with torch.no_grad():
        on, key_on, compiles_on, hlo_on = _compile_and_run(args, cache, tmp_path / "on")
        assert compiles_on == 1
        _native.set_cpu_ynn_fusion_types("")
        # Other options than the first compile's (dump_dir) make Dynamo trace anew; AOTAutograd's
        # cache then holds the first compile's entry, whose executable must not be taken.
        off, key_off, compiles_off, hlo_off = _compile_and_run(args, cache, tmp_path / "off")
        assert key_off != key_on
        assert compiles_off == 1
        assert "ynn_fusion" not in hlo_off
        if _makes_ynn_fusions():
            assert "__ynn_fusion" in hlo_on
        _native.set_cpu_ynn_fusion_types(None)
        again, key_again, compiles_again, _ = _compile_and_run(args, cache, tmp_path / "again")
        assert (key_again, compiles_again) == (key_on, 0)
    for got in (on, off, again):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert len(list(cache.glob("*.tpuc"))) == 2
