"""Fuzzer regression seed6035 (customop program): mismatch: call 0: output 0: -3.1415927410125732 vs eager -0.0 (max abs error 3.14)
(`v0 + 0` of -0.0 is +0.0; XLA folded the add away and kept -0.0)

def fn(v0):
    v1 = v0 + 0
    v2 = torch.atan2(v0, v1)
    return (v2,)

"""

from fuzz.customops import run_custom
from fuzz.gen import Program

PROGRAM = {
    "inputs": [[[], "f32"]],
    "nodes": [["{0} + 0", [0], 2], ["torch.atan2({0}, {1})", [0, 1], None]],
    "outputs": [2],
    "seed": 6035,
    "special": True,
}


def test_seed6035():
    outcome = run_custom(Program.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
