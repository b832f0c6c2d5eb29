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
    inputs, expected = sd.denoise(step, case)
    compiled = torch.compile(step, backend="tpu", dynamic=False, options={"fallback": "error"})
    ok, err, scale = sd.compare(sd.denoise(compiled, case, inputs)[1], expected)
    assert ok, f"max abs err {err:.3g} with outputs up to {scale:.3g}"
    s = tpuc.stats()
    assert s["fallback_ops"] == {}
    assert s["executions"] == sd.STEPS
    assert s["graphs_compiled"] == 1, "one graph, compiled once, serves every step"


def test_complex_data_movement_compiles():
    """`repeat`, `gather`, `full`, `copy`, `split`, `index` and `index_select` of complex
    tensors (Lumina2's, QwenImage's and HunyuanVideo 1.5's rotary frequencies) are lowered, not
    sent back to PyTorch."""

    def f(z, idx, dst):
        r = z.repeat(2, 1, 3)
        g = torch.gather(r, 1, idx)
        filled = torch.full((2, 3), 2.0, dtype=torch.complex64)
        a, b = torch.split(z, [1, 3], dim=1)
        rows = idx[0, :, 0] % 4
        return (
            g * 2,
            filled + z[0, :2, :3],
            dst.copy_(z[:, :1, :1]),
            a * 2,
            b + 1,
            z[:, rows] * 2,
            z.index_select(1, rows) + 1,
        )

    gen = torch.Generator().manual_seed(5)
    z = torch.complex(torch.randn(2, 4, 3, generator=gen), torch.randn(2, 4, 3, generator=gen))
    idx = torch.randint(0, 4, (4, 3, 9), generator=gen)
    expected = f(z, idx, torch.zeros(2, 1, 1, dtype=torch.complex64))
    compiled = torch.compile(f, backend="tpu", dynamic=False, options={"fallback": "error"})
    actual = compiled(z, idx, torch.zeros(2, 1, 1, dtype=torch.complex64))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert tpuc.stats()["fallback_ops"] == {}
