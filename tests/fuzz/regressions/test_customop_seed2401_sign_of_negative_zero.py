"""Fuzzer regression seed2401 (customop program): mismatch: call 2: output 0: inf at different places or signs
(`torch.sign(-0.0)` is +0.0; StableHLO's sign keeps -0.0)

def fn(v0):
    v1 = torch.sign(v0)
    v2 = torch.rsqrt(v1)
    return (v2,)

"""

from fuzz.customops import run_custom
from fuzz.gen import Program

PROGRAM = {
    "inputs": [[[2, 3, 2], "f32"]],
    "nodes": [["torch.sign({0})", [0], 4], ["torch.rsqrt({0})", [1], None]],
    "outputs": [2],
    "seed": 2401,
    "special": False,
}


def test_seed2401():
    outcome = run_custom(Program.from_dict(PROGRAM))
    assert outcome.kind in ("ok", "error"), outcome.detail
