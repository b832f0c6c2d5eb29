"""Fuzzer regression buffer_data_seed1000 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 2: -0.07113778591156006 vs eager -0.012406684458255768 (max abs error 0.498)

model (seed 1000, eval mode): b0=affine
input: float [2, 1]
call 0 (no_grad), input fresh: x = new
call 1 (no_grad), input fresh: x = new
  model.b0.scale.data = new  # buffer_data
call 2 (no_grad), input fresh: x = new
"""

from fuzz.stateful import ModuleProgram, run_module

PROGRAM = {
    "family": "module",
    "seed": 1000,
    "input": {"kind": "float", "shape": [2, 1]},
    "blocks": [["b0", "affine"]],
    "eval": True,
    "steps": [
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [["buffer_data", "b0.scale", 4]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_buffer_data_seed1000():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
