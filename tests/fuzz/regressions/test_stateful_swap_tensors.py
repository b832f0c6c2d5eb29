"""Fuzzer regression swap_tensors_seed1000 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): internal: call 1: swap_tensors(b1.conv.weight) raised RuntimeError: Cannot swap t1 because it has weakref associated with it

model (seed 1000, eval mode): b1=conv1d(3, 1, False)
input: float [2, 1, 1]
call 0 (no_grad), input fresh: x = new
  torch.utils.swap_tensors(model.b1.conv.weight, nn.Parameter(new))  # swap_tensors
call 1 (no_grad), input fresh: x = new
"""

from fuzz.stateful import ModuleProgram, run_module

PROGRAM = {
    "family": "module",
    "seed": 1000,
    "input": {"kind": "float", "shape": [2, 1, 1]},
    "blocks": [["b1", "conv1d", 3, 1, False]],
    "eval": True,
    "steps": [
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [["swap_tensors", "b1.conv.weight", 5]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_swap_tensors_seed1000():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
