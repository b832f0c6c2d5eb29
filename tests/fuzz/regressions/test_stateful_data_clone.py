"""Fuzzer regression data_clone_seed1000 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 2: -0.09045489877462387 vs eager -0.05691496282815933 (max abs error 0.284)

model (seed 1000, eval mode): b2=conv1d(4, 3, True)
input: float [2, 1, 1]
call 0 (no_grad), input fresh: x = new
call 1 (no_grad), input fresh: x = new
  model.b2.conv.weight.data = model.b2.conv.weight.data.clone()  # data_clone
call 2 (no_grad), input fresh: x = new
"""

from fuzz.stateful import ModuleProgram, run_module

PROGRAM = {
    "family": "module",
    "seed": 1000,
    "input": {"kind": "float", "shape": [2, 1, 1]},
    "blocks": [["b2", "conv1d", 4, 3, True]],
    "eval": True,
    "steps": [
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [["data_clone", "b2.conv.weight", 0]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_data_clone_seed1000():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
