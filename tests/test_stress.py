"""The short form of the stress runs (tests/stress_runs.py; the long form is bench/stress.py):
ResNet-18's training step and inference in fresh processes, each call of each process within tolerance of eager, every process exiting with status 0,
and every process computing the same bits. The last is what caught issue 48: oneDNN
implementations chosen by timing made one process's forward differ from another's in the last
bits, and a ReLU input within rounding of 0 then blocked a gradient in some processes only
(ResNet-18's layer4 weight gradients 0.3 off, relative)."""

from __future__ import annotations

import pytest
import stress_runs


def _check(runs):
    for r in runs:
        assert r.clean, (
            f"{r.model} {r.mode}: exit {r.returncode}, errors per call {r.errors}, ok {r.ok}, "
            f"results per call {r.digests}, worst {r.worst!r}\n{r.stderr_tail}"
        )
    digests = {r.digest for r in runs}
    assert len(digests) == 1, (
        f"{runs[0].model} {runs[0].mode}: {len(digests)} different results in {len(runs)} processes"
    )


# No spinner here: `make test` runs two pytest workers on two cores, so the other core is busy
# already (bench/stress.py adds one).
@pytest.mark.parametrize(("model", "mode", "runs"), [("resnet18", "train", 2), ("resnet18", "infer", 2)])
def test_fresh_processes_match_eager_and_each_other(model, mode, runs):
    _check([stress_runs.run_once(model, mode) for _ in range(runs)])


def test_serial_handoffs_compute_the_same_bits():
    """`TPUC_DEBUG=serial` (every host-kernel piece on the calling thread) changes who computes,
    not what: GPT-2's host products, rows and attention give the bits they give with helper
    threads, so a difference that appears only with helpers is a race."""
    _check([stress_runs.run_once("gpt2", "infer", debug=d) for d in ("serial", "")])
