"""Where the time of a compiled call goes (`TPUC_LOG=debug`).

With `TPUC_LOG` at debug for tpuc (`debug`, `trace`, `tpuc=debug`), or the Python logger `tpuc`
at DEBUG when a graph is compiled, every call of that graph is timed phase by phase and the
logger `tpuc.calls` reports the median time per phase over the last `TPUC_DEBUG=profile_every=N`
calls (default 1000), after the first call and then every that many calls:

    tpuc: g1_forward: 1000 planned calls (0 general), median us per call over the last 1000:
    plan 0.4, inputs 0.3, upload 0.0, execute 2.4, outputs 0.8, rust_call 0.3; sum 4.2

- `plan`: the shape lookup and argument list (the general path's work before the plan);
- `inputs`: checking each tensor against the plan, resident parameters, data pointers;
- `upload`: wrapping host inputs as PJRT buffers (no copy on the CPU plugin);
- `execute`: PJRT execute until the outputs are ready;
- `outputs`: handing the outputs to torch (in place through DLPack on the CPU plugin, else a
  fresh tensor and a copy) and assembling the returned list;
- `rust_call`: the rest of the call into Rust (argument conversion, releasing the GIL).

Calls that do not fit the plan (non-contiguous inputs, another device) are counted as
`general`. Without the setting none of this runs: the hot path only checks one attribute.
`call_profiles()` returns the numbers so far.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import sys
import threading

from . import env

log = logging.getLogger("tpuc.calls")

_PHASES = ("plan", "inputs", "upload", "execute", "outputs", "rust_call")
_profiles: list[CallProfile] = []
_lock = threading.Lock()
_handler_added = False


def _env_wants_debug(value: str | None) -> bool:
    """Whether a TPUC_LOG filter turns debug on for tpuc: a bare `debug`/`trace`, or a
    directive for `tpuc` itself (`tpuc=debug`)."""
    if not value:
        return False
    for directive in value.split(","):
        directive = directive.strip().lower()
        target, _, level = directive.rpartition("=")
        if level in ("debug", "trace") and target in ("", "tpuc"):
            return True
    return False


def enabled() -> bool:
    """Whether graphs compiled now should time their calls."""
    global _handler_added
    if _env_wants_debug(os.environ.get("TPUC_LOG")):
        with _lock:
            if not _handler_added and not logging.getLogger("tpuc").handlers:
                # TPUC_LOG sends tpuc's logs to stderr (as it does for the Rust side).
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("%(message)s"))
                log.addHandler(handler)
                log.setLevel(logging.DEBUG)
            _handler_added = True
        return True
    return logging.getLogger("tpuc").isEnabledFor(logging.DEBUG)


#: Calls between two reports of a graph's phase times, unless TPUC_DEBUG=profile_every=N.
PROFILE_EVERY = 1000


def _every() -> int:
    return max(1, env.debug("profile_every") or PROFILE_EVERY)


class CallProfile:
    """Accumulated phase times (nanoseconds) of one compiled graph's calls."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0
        self.general = 0
        self.every = _every()
        # The last `every` samples of each phase: medians resist the outliers (preemption,
        # page faults) that dominate means on a shared machine.
        self.samples = {k: collections.deque(maxlen=self.every) for k in _PHASES}
        self.lock = threading.Lock()
        with _lock:
            _profiles.append(self)

    def add(self, **phases: int) -> None:
        with self.lock:
            self.calls += 1
            for k, v in phases.items():
                self.samples[k].append(v)
            report = self.calls == 1 or self.calls % self.every == 0
        if report:
            log.debug("%s", self.summary())

    def count_general(self) -> None:
        with self.lock:
            self.general += 1

    def per_call_us(self) -> dict:
        """Median microseconds per phase over the last `every` calls."""
        with self.lock:
            return {k: statistics.median(v) / 1e3 if v else 0.0 for k, v in self.samples.items()}

    def summary(self) -> str:
        per = self.per_call_us()
        phases = ", ".join(f"{k} {v:.1f}" for k, v in per.items())
        return (
            f"tpuc: {self.name}: {self.calls} planned calls ({self.general} general), "
            f"median us per call over the last {min(self.calls, self.every)}: {phases}; "
            f"sum {sum(per.values()):.1f}"
        )


def call_profiles() -> dict:
    """{graph name: {"calls", "general", phase: median us per call}} for graphs that time
    their calls (medians over each graph's last PROFILE_EVERY calls, or TPUC_DEBUG=profile_every=N)."""
    with _lock:
        profiles = list(_profiles)
    return {p.name: {"calls": p.calls, "general": p.general, **p.per_call_us()} for p in profiles}
