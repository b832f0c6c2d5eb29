"""Zoo models compiled and run in many fresh processes, each result checked against eager: the
short form runs in `make test` (tests/test_stress.py), the long form is `bench/stress.py`.

A fault that shows in some processes only (a choice made per process, a race between threads, an
abort at exit) passes a test that runs once. Each run here is a fresh process that compiles one
zoo model with `backend="tpu"`, calls it three times (the first call, which makes every
primitive and buffer, and two steady calls) and compares every result with eager's:
inference outputs, or for training the loss, every parameter's gradient and the BatchNorm
statistics (`zoo.assert_close_to_eager_or_float64`, as tests/test_zoo_training.py does). It also
hashes every call's results: the steady calls must give the first call's bits (the same
executable on the same inputs), and runs of the same program the same bits across processes; and the parent reads each process's exit status, so that an
abort at interpreter exit is a failure too. `busy_core()` keeps another core loaded meanwhile:
thread timings then differ from one run to the next, as they do on a loaded machine.

    python tests/stress_runs.py MODEL MODE   one run (MODE: infer or train), one JSON line out
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Calls per run: the first, then steady calls, each compared with eager.
CALLS = 3
# Inference outputs: within this of eager's, relative to the output's largest magnitude (the
# zoo tests' own tolerance, tests/test_zoo.py).
INFER_REL = 1e-5


@dataclass
class Run:
    """One fresh process's outcome."""

    model: str
    mode: str
    returncode: int
    seconds: float
    # Per call: the worst error relative to the tensor's scale, and whether it was within tolerance.
    errors: list[float]
    ok: list[bool]
    # Per call: a hash of its results; `digest` is the first call's.
    digests: list[str]
    worst: str
    stderr_tail: str

    @property
    def digest(self) -> str:
        return self.digests[0] if self.digests else ""

    @property
    def clean(self) -> bool:
        """Every call matched eager, every steady call gave the first call's bits, and the
        process exited with status 0."""
        return self.returncode == 0 and len(self.ok) == CALLS and all(self.ok) and len(set(self.digests)) == 1


def _digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _relative(actual, expected) -> float:
    if not actual.is_floating_point() or not actual.numel():
        return 0.0 if bool((actual == expected).all()) else float("inf")
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-30)


def _child_infer(name: str) -> dict:
    import torch
    import zoo

    model, inputs = zoo.make(name)
    with torch.no_grad():
        want = model(*inputs)
        compiled = torch.compile(model, backend="tpu", dynamic=False)
        got = [compiled(*inputs) for _ in range(CALLS)]
    errors = [_relative(g, want) for g in got]
    return {
        "errors": errors,
        "ok": [e <= INFER_REL for e in errors],
        "digests": [_digest([g]) for g in got],
        "worst": "output",
    }


def _child_train(name: str) -> dict:
    import torch
    import zoo

    eager, inputs = zoo.training_setup(name)
    exact = copy.deepcopy(eager).double()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpu", dynamic=False)

    def step(module, fn, args):
        module.zero_grad(set_to_none=True)
        loss = fn(*args)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    # Eager's gradients from the same start for every call (no optimizer step between calls);
    # BatchNorm's running statistics move with every call, so they are compared after the last.
    want_loss, want = step(eager, eager, inputs)
    _, exact_grads = step(exact, exact, tuple(x.double() if x.is_floating_point() else x for x in inputs))
    for _ in range(CALLS - 1):
        eager(*inputs)
    errors, ok, digests, worst = [], [], [], ""
    for _ in range(CALLS):
        loss, grads = step(model, compiled, inputs)
        call_ok, call_err = True, _relative(loss, want_loss)
        call_ok &= call_err <= 1e-4
        for n, g in grads.items():
            err = _relative(g, want[n])
            try:
                zoo.assert_close_to_eager_or_float64(g, want[n], exact_grads[n], n)
            except AssertionError:
                call_ok = False
                worst = n
            call_err = max(call_err, err)
        errors.append(call_err)
        ok.append(call_ok)
        digests.append(_digest([loss, *grads.values()]))
    buffers_ok = True
    for (bname, b), be in zip(model.named_buffers(), eager.buffers(), strict=True):
        if b.is_floating_point() and _relative(b, be) > 1e-5:
            buffers_ok, worst = False, bname
    ok[-1] = ok[-1] and buffers_ok
    return {"errors": errors, "ok": ok, "digests": digests, "worst": worst}


def run_once(name: str, mode: str, timeout: float = 600, debug: str | None = None) -> Run:
    """One fresh process running zoo model `name` in `mode` ("infer" or "train"), with
    `TPUC_DEBUG=debug` where given."""
    env = os.environ.copy()
    if debug is not None:
        env["TPUC_DEBUG"] = debug
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, __file__, name, mode],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        returncode, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stdout, stderr = -999, e.stdout or "", f"timed out after {timeout} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    seconds = time.perf_counter() - t0
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
    result = json.loads(line) if line else {"errors": [], "ok": [], "digests": [], "worst": "no result"}
    return Run(
        name,
        mode,
        returncode,
        seconds,
        result["errors"],
        result["ok"],
        result["digests"],
        result["worst"],
        "\n".join(stderr.splitlines()[-15:]),
    )


@contextlib.contextmanager
def busy_core():
    """Another core kept busy (a Python loop in a child process) for the duration."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE))
    name, mode = argv
    result = _child_infer(name) if mode == "infer" else _child_train(name)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
