"""Zoo models in training through backend="tpu", against eager: loss, every parameter gradient
and BatchNorm running statistics after a forward/backward step, then again after an optimizer
step between compiled steps (the updated parameters are uploaded again)."""

from __future__ import annotations

import copy

import pytest
import torch
import zoo
from torch import nn

import tpuc

# A decoder LM with learned positions, one with rotary embeddings, an encoder, an
# encoder-decoder, two vision transformers and a CNN with BatchNorm and max pooling.
MODELS = ["gpt2", "llama", "bert", "t5", "vit", "swin", "resnet18"]

STEPS = 2


@pytest.mark.parametrize("name", MODELS)
def test_zoo_training_step_matches_eager(name):
    eager, inputs = zoo.training_setup(name)
    exact = copy.deepcopy(eager).double()
    exact_inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    opt_x = torch.optim.SGD(exact.parameters(), lr=1e-3, momentum=0.9)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpu", dynamic=False, options={"fallback": "error"})
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-3, momentum=0.9)
    opt_c = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for step in range(STEPS):
        loss_e = eager(*inputs)
        loss_e.backward()
        loss_c = compiled(*inputs)
        loss_c.backward()
        exact(*exact_inputs).backward()
        zoo.assert_close_scaled(loss_c.detach(), loss_e.detach(), f"step {step}: loss")
        for (pname, p), pe, px in zip(
            model.named_parameters(), eager.parameters(), exact.parameters(), strict=True
        ):
            assert (p.grad is None) == (pe.grad is None), f"step {step}: {pname} grad presence"
            if p.grad is not None:
                zoo.assert_close_to_eager_or_float64(
                    p.grad, pe.grad, px.grad, f"step {step}: grad of {pname}"
                )
        for (bname, b), be in zip(model.named_buffers(), eager.buffers(), strict=True):
            zoo.assert_close_scaled(b, be, f"step {step}: buffer {bname}", rel=1e-5)
        for opt in (opt_e, opt_c, opt_x):
            opt.step()
            opt.zero_grad()
    if has_bn:
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        assert bn.num_batches_tracked.item() == STEPS
    for (pname, p), pe, px in zip(
        model.named_parameters(), eager.parameters(), exact.parameters(), strict=True
    ):
        zoo.assert_close_to_eager_or_float64(
            p.detach(), pe.detach(), px.detach(), f"{pname} after {STEPS} steps"
        )
    s = tpuc.stats()
    assert s["fallback_ops"] == {}
    assert s["graphs_compiled"] == 2, "one forward and one backward graph"
    assert s["executions"] == 2 * STEPS
