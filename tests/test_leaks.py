"""Long runs leak nothing: resident memory settles, PJRT buffers and events do not pile up (counted
by the runtime itself, `_native.live_objects()`), file descriptors stay the same.
The 100,000-call version is `python bench/long_run.py`."""

from __future__ import annotations

import gc
import os

import torch
from torch import nn

import tpuc
from tpuc import _native


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def compiled(fn):
    return torch.compile(fn, backend="tpu", dynamic=False, options={"fallback": "error", "cache_dir": None})


def test_live_objects_counts_buffers_of_a_call():
    f = compiled(lambda x: x * 2)
    x = torch.randn(64)
    torch.testing.assert_close(f(x), x * 2)
    live = _native.live_objects()
    assert set(live) == {"buffers", "events", "executables"}
    assert live["executables"] >= 1
    for _ in range(10):  # new inputs each call: no buffer outlives its call
        f(torch.randn(64))
    gc.collect()
    assert _native.live_objects()["buffers"] <= live["buffers"] + 1


def test_inference_calls_with_changing_inputs_leak_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    f = compiled(model)
    shapes = [(16, 64), (32, 64), (8, 64)]  # one executable each
    calls = 3000

    def step(k):
        x = torch.randn(shapes[k % 3])
        out = f(x)
        if k % 500 == 0:
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for k in range(calls // 2):
            step(k)
        gc.collect()
        live_mid, rss_mid, fds_mid = _native.live_objects(), rss_bytes(), open_fds()
        executions = tpuc.stats()["executions"]
        for k in range(calls // 2, calls):
            step(k)
        gc.collect()
        live_end, rss_end, fds_end = _native.live_objects(), rss_bytes(), open_fds()
    assert tpuc.stats()["executions"] - executions == calls // 2  # every call ran through tpuc
    assert live_end == live_mid, (live_mid, live_end)
    assert fds_end == fds_mid
    # A leaked output (16x64 floats = 4 KiB) per call would grow RSS by 6 MB over the second half.
    growth = rss_end - rss_mid
    assert growth < 1 << 20, f"RSS grew by {growth / 1e6:.2f} MB over the last {calls // 2} calls"


def test_training_steps_leak_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    f = compiled(model)

    def step():
        x = torch.randn(8, 16)
        loss = f(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(200):
        step()
    gc.collect()
    live_mid, rss_mid, fds_mid = _native.live_objects(), rss_bytes(), open_fds()
    for _ in range(400):
        step()
    gc.collect()
    assert _native.live_objects() == live_mid
    assert open_fds() == fds_mid
    growth = rss_bytes() - rss_mid
    assert growth < 1 << 20, f"RSS grew by {growth / 1e6:.2f} MB over 400 training steps"
    assert tpuc.stats()["xla_compiles"] == 2  # forward and backward, compiled once
