"""A seeded short differential fuzzing run (the long run: `python tests/fuzz/cli.py --count 10000`).

Every program runs eagerly and through tpuc with fallback="error"; tpuc must give eager's results
or a clear tpuc error (UnsupportedOpError, TpucError, ValueError), never a silent mismatch or an
internal error. A failure prints the shrunk program as a standalone reproducer."""

from __future__ import annotations

import collections
import os

from fuzz.gen import generate
from fuzz.runner import reproducer, run, shrink

SEED = 20261202
COUNT = int(os.environ.get("TPUC_FUZZ_COUNT", "150"))


def test_fuzz_short_run():
    counts: collections.Counter = collections.Counter()
    failures = []
    for k in range(COUNT):
        program = generate(SEED + k)
        outcome = run(program)
        counts[outcome.kind if outcome.kind != "error" else f"error:{outcome.error_type}"] += 1
        if outcome.bad and len(failures) < 3:
            small, small_outcome = shrink(program, outcome, budget=30)
            failures.append(reproducer(small, small_outcome, f"seed{SEED + k}"))
    print(f"fuzz: {COUNT} programs: {dict(counts)}")
    assert counts["ok"] >= COUNT * 0.8, dict(counts)  # the generator makes mostly supported programs
    assert not failures, "\n\n".join(failures)


DYNAMIC_COUNT = int(os.environ.get("TPUC_FUZZ_DYNAMIC_COUNT", "30"))


def test_fuzz_short_run_with_dynamic_dims():
    # Dim 0 of the full-rank inputs marked dynamic with a declared maximum (so tpuc pads it to a
    # bucket), one compiled function called at two sizes.
    import random

    from fuzz.runner import run_dynamic

    counts: collections.Counter = collections.Counter()
    failures = []
    for k in range(DYNAMIC_COUNT):
        seed = SEED + 7919 * (k + 1)
        program = generate(seed)
        rng = random.Random(seed)
        outcome = run_dynamic(program, (rng.randint(2, 16), rng.randint(2, 16)))
        counts[outcome.kind if outcome.kind != "error" else f"error:{outcome.error_type}"] += 1
        if outcome.bad:
            failures.append(f"seed {seed}: {outcome.detail}\n{program.source()}{program.inputs}")
    print(f"fuzz (dynamic dims): {DYNAMIC_COUNT} programs: {dict(counts)}")
    assert counts["ok"] >= DYNAMIC_COUNT * 0.3, dict(counts)
    assert not failures, "\n\n".join(failures)


# 100 programs reach every mutation kind, input policy and custom op of the family (the
# last to appear first does at seed offset 76; the test checks they all do); the long run
# (bench/results/fuzz_long_stateful.json) goes further.
STATEFUL_COUNT = int(os.environ.get("TPUC_FUZZ_STATEFUL_COUNT", "100"))
# The custom ops of customops.py (the names program_kinds reports).
CUSTOM_OPS = {"np_affine", "t_affine", "host_roll", "host_repeat", "host_count", "every_other", "swap_last"}
CUSTOM_OPS |= {"neg_", "clamp_", "add_into"}


def test_fuzz_stateful_short_run():
    # The stateful family (tests/fuzz/stateful.py): modules whose parameters and buffers are
    # changed between calls (.data =, set_, swap_tensors, storage resizes, load_state_dict, dtype
    # round trips ...), compared with eager after every call, and gen.py programs with custom ops
    # at random positions (fallback="eager" partitions around them). About 0.4 s a program.
    from fuzz.stateful import (
        ALL_KINDS,
        INPUT_POLICIES,
        failure_blame,
        generate_stateful,
        mode_of,
        program_kinds,
        reproducer,
        run_stateful,
        shrink_stateful,
    )

    counts: collections.Counter = collections.Counter()
    failures = []
    reached: set[str] = set()
    for k in range(STATEFUL_COUNT):
        seed = SEED + k
        program = generate_stateful(seed)
        reached.update(program_kinds(program))
        outcome = run_stateful(program)
        kind = outcome.kind if outcome.kind != "error" else f"error:{outcome.error_type}"
        counts[f"{mode_of(program)}:{kind}"] += 1
        if outcome.bad and len(failures) < 3:
            small, small_outcome = shrink_stateful(program, outcome, budget=20)
            blamed = ", ".join(failure_blame(small, small_outcome))
            failures.append(f"[{blamed}]\n" + reproducer(small, small_outcome, f"seed{seed}"))
    print(f"fuzz (stateful): {STATEFUL_COUNT} programs: {dict(counts)}")
    ok = sum(n for k, n in counts.items() if k.endswith(":ok"))
    assert ok >= STATEFUL_COUNT * 0.8, dict(counts)
    assert not failures, "\n\n".join(failures)
    # "fresh" and "reuse" are the plain input policies, which program_kinds does not name.
    every = {*ALL_KINDS, *CUSTOM_OPS, *(f"input:{p}" for p in INPUT_POLICIES if p not in ("fresh", "reuse"))}
    if STATEFUL_COUNT >= 100:
        assert every <= reached, f"no program here has {sorted(every - reached)}: run more programs"


def test_fuzz_custom_ops_match_their_fakes():
    # The custom ops of the stateful family (customops.py) must keep their own contracts (fake
    # shapes, no aliasing, declared mutations), or their mismatches would look like tpuc's.
    import torch

    from fuzz.customops import register

    register()
    ops = torch.ops.tpucfuzz
    checks = ("test_schema", "test_faketensor")
    for shape in [(), (0,), (3,), (2, 0, 3), (1, 4, 2)]:
        x = torch.randint(-4, 5, shape).float()
        k = torch.tensor([2, -1])
        cases = [
            (ops.np_affine, (x,)),
            (ops.np_affine, (x.long(),)),
            (ops.t_affine, (x, 0.5, 1.0)),
            (ops.host_roll, (x, k)),
            (ops.host_repeat, (x, k)),
            (ops.every_other, (x,)),
            (ops.swap_last, (x,)),
            (ops.neg_, (x.clone(),)),
            (ops.clamp_, (x.clone(), -1.0, 2.0)),
            (ops.add_into, (x.clone(), x)),
        ]
        if shape:
            cases.append((ops.host_count, (x,)))
        for op, args in cases:
            torch.library.opcheck(op, args, test_utils=checks)
