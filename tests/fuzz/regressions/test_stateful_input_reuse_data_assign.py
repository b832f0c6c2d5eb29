"""Fuzzer regression input_reuse_data_assign_seed1016 (module program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 2: 0.28816407918930054 vs eager -1.1758196353912354 (max abs error 1.89)

model (seed 1016, eval mode): b0=embed(4, None)
input: tokens [2, 1] < 5
call 0 (no_grad), input fresh: x = new
call 1 (no_grad), input reuse: x: the previous call's tensor
call 2 (no_grad), input reuse_data_assign: x.data = new
"""

from fuzz.stateful import ModuleProgram, run_module

PROGRAM = {
    "family": "module",
    "seed": 1016,
    "input": {"kind": "tokens", "shape": [2, 1], "vocab": 5},
    "blocks": [["b0", "embed", 4, None]],
    "eval": True,
    "steps": [
        {"mut": [], "input": "fresh", "grad": "no_grad"},
        {"mut": [], "input": "reuse", "grad": "no_grad"},
        {"mut": [], "input": "reuse_data_assign", "grad": "no_grad"},
    ],
}


def test_input_reuse_data_assign_seed1016():
    outcome = run_module(ModuleProgram.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
