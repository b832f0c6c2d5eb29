"""The fast subset of the diffusers sweep (bench/sweep_diffusers.py): a UNet with cross
attention, two DiT-style transformers (class-conditioned DiT, SD3's MMDiT) and the KL
autoencoder, each built from the sweep's tiny config and run for the sweep's Euler steps with
backend="tpu" (fallback="error") against eager, at the sweep's tolerance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tpuc

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import sweep_diffusers as sd  # noqa: E402


@pytest.mark.parametrize(
    "name", ["UNet2DConditionModel", "DiTTransformer2DModel", "SD3Transformer2DModel", "AutoencoderKL"]
)
def test_denoising_steps_match_eager(name):
    case = sd.build(name)
    step = sd.Step(case)
    expected = sd.denoise(step, case)
    compiled = torch.compile(step, backend="tpu", dynamic=False, options={"fallback": "error"})
    ok, err, scale = sd.compare(sd.denoise(compiled, case), expected)
    assert ok, f"max abs err {err:.3g} with outputs up to {scale:.3g}"
    s = tpuc.stats()
    assert s["fallback_ops"] == {}
    assert s["executions"] == sd.STEPS
    assert s["graphs_compiled"] == 1, "one graph, compiled once, serves every step"
