"""glibc's malloc tuned for XLA's CPU executables, once per process, before the CPU plugin starts.

XLA's CPU executables take their temporaries (and outputs) from the C heap on every call. glibc
serves each block of more than 32 MiB with a fresh `mmap` and returns it with `munmap`, and its
per-thread arenas unmap whole heaps when they empty, so every call of a large graph page-faults
its temporaries in again: 260-300k faults per ResNet-50 batch-8 training step, half of its time.
One arena that keeps freed memory (what `MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0` and a
`MALLOC_TRIM_THRESHOLD_` above the peak heap set at process start) takes that to no faults: GPT-2 124M training step
750-1200 -> 380-440 ms, ResNet-50 batch-8 training step 1440-2020 -> 920-940 ms, the diffusion UNet
step (1 GiB of attention temporaries) 740 -> 370 ms (docs/host-kernels.md, "The C heap"). The process keeps
its peak heap instead of returning freed memory to the system (a bound, such as 1 GiB, was measured
to bring every fault back as soon as one graph's temporaries exceed it).

The settings are process-wide, so tpuc leaves them alone when the user tuned malloc
(`_USER_SETTINGS`: glibc's malloc tunables in the environment; debugging ones such as
`MALLOC_CHECK_` do not count) or turned it off (`TPUC_HOST_KERNELS=-malloc`), and off glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from . import env

_log = logging.getLogger("tpuc")

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# mallopt(3): a trim threshold of -1 disables trimming.
NEVER_TRIM = -1
# glibc's per-thread heaps are at most 64 MiB; a top pad that large keeps emptied ones.
THREAD_HEAP_BYTES = 64 << 20

_USER_SETTINGS = (
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_TRIM_THRESHOLD_",
)

_state: str | None = None


def tune_for_xla_cpu() -> str:
    """Tune glibc's malloc (first call only) and say what was done: "tuned", or why not."""
    global _state
    if _state is None:
        _state = _tune()
        _log.info("tpuc: host malloc %s", _state)
    return _state


def _tune() -> str:
    if not env.host_kernel("malloc"):
        return "left alone (TPUC_HOST_KERNELS turns malloc off)"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if user:
        return f"left alone (the environment sets {', '.join(user)})"
    if platform.libc_ver()[0] != "glibc":
        return "left alone (not glibc)"
    libc = ctypes.CDLL(None)
    # Arena first: threads that start afterwards (XLA's pool) share the main heap.
    for param, value in (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_MAX, 0),
        (_M_TRIM_THRESHOLD, NEVER_TRIM),
        (_M_TOP_PAD, THREAD_HEAP_BYTES),
    ):
        if libc.mallopt(param, value) != 1:
            return f"left partly tuned (mallopt({param}, {value}) failed)"
    return "tuned"
