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
