"""A clean exit, every time: the short form of `bench/stress_exit.py` (fresh processes that
compile, run and exit: inference, a training step; and a DDP and an FSDP2 run of two gloo
processes each; the daemon-thread kind is in the long form only, see `SHORT`). Any process
that ends abnormally (a signal such as SIGABRT, a nonzero status, a hang, or "terminate called" /
"Fatal Python error" / a Rust panic in its output) fails the test with its output. The long form
(many runs, busy cores) is `bench/stress_exit.py`, its results in bench/results/stress_exit.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "stress_exit.py"


def test_processes_that_compile_run_and_exit_end_cleanly(tmp_path):
    out = tmp_path / "stress_exit.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--short", "--busy", "0", "--jobs", "2", "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    failures = "\n\n".join(
        f"{f['kind']}: exit codes {f['codes']}, hang={f['hang']}, {f['bad_output']}\n{f['tail']}"
        for f in report["failures"]
    )
    assert report["abnormal"] == 0, failures
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = importlib.util.spec_from_file_location("stress_exit", SCRIPT)
    short = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(short)
    assert report["runs"] == sum(short.SHORT.values())


_HOOK_CHILD = """
import json, torch
import tpuc
from tpuc import runtime
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
f = torch.compile(model, backend="tpu")
x = torch.randn(64, 1024)
with torch.no_grad():
    torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
print(json.dumps(runtime._at_exit()))
"""


def test_the_exit_hook_leaves_nothing_in_flight_and_joins_the_helpers():
    proc = subprocess.run([sys.executable, "-c", _HOOK_CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["in_flight"] == 0 and report["parked"] == 0, report
    assert report["helpers_left"] == 0, report
    assert report["runtimes_kept"] >= 1, report
    assert report["waited_s"] < 5, report
