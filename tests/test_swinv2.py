"""Swin-V2's first call (issue 44): its residual stream, adds between `[B, H, W, C]` and
`[B, H*W, C]` views with the layer norms in the host row kernel, fused into one XLA fusion whose
code generation ran past 20 minutes on lammps-jax-pjrt-cpu 0.11.2 (the lowering now materializes
values deep in reshape chains, and merges adjacent transposed dims)."""

from __future__ import annotations

import time

import pytest
import torch

timm_swin = pytest.importorskip("timm.models.swin_transformer_v2_cr")

# The full model's depths (stage 3's six blocks make the long chain) at a quarter of its width.
CONFIG = dict(img_size=(224, 224), depths=(2, 2, 6, 2), num_heads=(1, 2, 4, 8), embed_dim=32, num_classes=10)
FIRST_CALL_LIMIT_S = 60.0


def test_swinv2_cr_first_call_is_quick_and_right():
    torch.manual_seed(0)
    model = timm_swin.SwinTransformerV2Cr(**CONFIG).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, backend="tpu")
        t0 = time.perf_counter()
        got = compiled(x)
        seconds = time.perf_counter() - t0
    assert seconds < FIRST_CALL_LIMIT_S, f"first call took {seconds:.1f} s"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
