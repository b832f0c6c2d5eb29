"""Fuzzer regression customop_input_data_assign_seed311 (customop program), on the build of 3396d43 (fixed by faf8c9d, residency keyed on memory): mismatch: call 3: output 0: -2.2449696998428683e-25 vs eager -2.25 (max abs error 2.25)

def fn(v0):
    v1 = torch.clamp(v0, min=v0.amin(), max=v0.amax() * 0.5)
    return (v1,)

"""

from fuzz.customops import run_custom
from fuzz.gen import Program

PROGRAM = {
    "inputs": [[[1], "f32"]],
    "nodes": [["torch.clamp({0}, min={0}.amin(), max={0}.amax() * 0.5)", [0], 2]],
    "outputs": [1],
    "seed": 311,
    "special": False,
}


def test_customop_input_data_assign_seed311():
    outcome = run_custom(Program.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
