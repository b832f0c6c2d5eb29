"""Fuzzer regression call_double_seed1000 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 3: -5.440877873114052e-06 vs eager 0.07028996115549724 (max abs error 0.179)

model (seed 1000, eval mode): b1=conv1d(3, 1, False)
input: float [2, 1, 1]
call 0 (no_grad), input fresh: x = new
  model.double(); call with x.double(); model.float()  # call_double
call 1 (no_grad), input fresh: x = new
  model.double(); call with x.double(); model.float()  # call_double
call 2 (no_grad), input fresh: x = new
  model.double(); call with x.double(); model.float()  # call_double
call 3 (no_grad), input fresh: x = new
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
        {"mut": [["call_double", "", 1]], "input": "fresh", "grad": "no_grad"},
        {"mut": [["call_double", "", 5]], "input": "fresh", "grad": "no_grad"},
        {"mut": [["call_double", "", 1]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_call_double_seed1000():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
