"""Factories for `tpuc precompile MODULE:FACTORY`: each returns (model, example_inputs, dynamic)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for models.py

from models import make  # noqa: E402


def mlp():
    """The reference MLP with its batch dim dynamic up to 16 (what run_model.py --seed 0 builds)."""
    model, inputs = make("mlp", batch=4, seed=0)
    return model, inputs, {0: {0: 16}}


def mlp_step():
    """A whole AdamW training step of a small MLP (`tpuc precompile --step`), static shapes:
    the step of test_targets' precompile test, so a precompile of both shares its executable."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, [torch.randn(64, 256), torch.randn(64, 256)], {}
