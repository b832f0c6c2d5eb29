"""Fuzzer regression data_strided_seed1001 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 2: -3687582684676096.0 vs eager -1.0011343955993652 (max abs error 3.69e+15)

model (seed 1001, eval mode): b1=bn
input: float [2, 1, 1]
call 0 (no_grad), input fresh: x = new
call 1 (no_grad), input fresh: x = new
  model.b1.bn.weight.data = longer[1:-1].view(new.shape)  # new's values at storage offset 1  # data_strided
call 2 (no_grad), input fresh: x = new
"""

from fuzz.stateful import ModuleProgram, run_module

PROGRAM = {
    "family": "module",
    "seed": 1001,
    "input": {"kind": "float", "shape": [2, 1, 1]},
    "blocks": [["b1", "bn"]],
    "eval": True,
    "steps": [
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [["data_strided", "b1.bn.weight", 5]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_data_strided_seed1001():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
