"""Fuzzer regression bf16_roundtrip_seed1000 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 2: -1.0961002748889961e-13 vs eager -0.0924198105931282 (max abs error 0.783)

model (seed 1000, eval mode): b1=conv1d(3, 1, False)
input: float [2, 1, 1]
call 0 (no_grad), input fresh: x = new
call 1 (no_grad), input fresh: x = new
  model.bfloat16(); model.float()  # bf16_roundtrip
call 2 (no_grad), input fresh: x = new
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
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [["bf16_roundtrip", "", 5]], "input": "fresh", "grad": "no_grad"},
    ],
}


def test_bf16_roundtrip_seed1000():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
