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
