"""Every model of the zoo (tests/zoo.py) in inference through backend="tpu", against eager.

float32 under torch.no_grad(), fallback="error": every op of every model has a lowering rule.
"""

from __future__ import annotations

import pytest
import torch
import zoo

import tpuc

# Deep models accumulate rounding differences (summation order in matmuls and reductions);
# measured errors are 1e-6 or below.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_zoo_inference_matches_eager(name):
    model, inputs = zoo.make(name)
    with torch.no_grad():
        expected = model(*inputs)
        compiled = torch.compile(model, backend="tpu", dynamic=False, options={"fallback": "error"})
        actual = compiled(*inputs)
    assert isinstance(actual, torch.Tensor)
    torch.testing.assert_close(actual, expected, **TOL)
    s = tpuc.stats()
    assert s["fallback_ops"] == {}
    assert s["graphs_compiled"] == 1, "the model compiles as one graph (no graph breaks)"
    assert s["executions"] == 1


def test_zoo_is_broad():
    families = {
        "decoder": {"gpt2", "llama", "mistral", "qwen2", "phi", "gpt_neox"},
        "encoder": {"bert", "roberta", "distilbert"},
        "encoder-decoder": {"t5", "bart"},
        "vision transformer": {"vit", "swin", "convnext"},
        "cnn": {"resnet18", "mobilenet_v2", "mobilenet_v3", "efficientnet_b0"},
    }
    for family, names in families.items():
        assert names <= set(zoo.NAMES), family
    assert len(zoo.NAMES) >= 20
