"""tpuc's two switch variables, read by the Rust side's one parser (runtime/src/env.rs), so that
their names, values and error texts are defined in one place (docs/api.md, "Environment
variables"):

- `TPUC_HOST_KERNELS`: which host paths the CPU plugin's compiles take. `auto` (the default:
  each where it applies), `off`, a comma list of paths to keep on (`gemm,conv`), or of
  `-path`s to turn off (`-rows,-torch`). Paths: `host_kernel_names()`.
- `TPUC_DEBUG`: debugging and test hooks, `key` or `key=value` items separated by commas
  (`discrete_device,module_format=text`). Keys: `debug_keys()`.

A malformed value of either raises ValueError naming what is accepted. Also the variables tpuc
no longer reads, each with what replaced it (`RETIRED`): one that is set warns once."""

from __future__ import annotations

import os
import threading
import warnings

from . import _native

HOST_KERNELS = "TPUC_HOST_KERNELS"
DEBUG = "TPUC_DEBUG"


def host_kernels(value: str | None = None) -> dict[str, bool]:
    """{path: on} for every host path: `value`, or TPUC_HOST_KERNELS as set now."""
    return dict(_native.host_kernels(value))


def host_kernel_names() -> list[str]:
    return list(host_kernels("auto"))


def host_kernel(name: str) -> bool:
    """Whether TPUC_HOST_KERNELS, as set now, leaves host path `name` on."""
    return host_kernels()[name]


def debug_keys() -> dict[str, tuple[str, list[str], str]]:
    """{key: (kind, values, what)} of every TPUC_DEBUG key: kind "flag" (`key`, or `key=` an
    on/off word), "count" (`key=N`) or "choice" (`key=` one of values)."""
    return {name: (kind, values, what) for name, kind, values, what in _native.debug_keys()}


def debug(key: str, value: str | None = None) -> bool | int | str | None:
    """TPUC_DEBUG's value (or `value`'s) for `key`: True/False for a flag, an int for a count, a
    word for a choice; None (a flag: False) where it is not given."""
    kind = debug_keys()[key][0]  # KeyError: not a key (a bug, not a user's error)
    got = _native.debug_settings(value).get(key)
    return False if got is None and kind == "flag" else got


# Variables tpuc read before issue 42, each with what replaced it. They are spelled without the
# "TPUC_" prefix so that the names the code reads (docs/api.md lists every one;
# tests/test_contract.py checks it both ways) are only the live ones; docs/api.md, "Retired
# variables", lists these. One that is set is ignored with a warning (`check`).
RETIRED = {
    "HOST_GEMM": "TPUC_HOST_KERNELS=-gemm",
    "HOST_CONV": "TPUC_HOST_KERNELS=-conv",
    "HOST_ROWS": "TPUC_HOST_KERNELS=-rows",
    "TORCH_KERNELS": "TPUC_HOST_KERNELS=-torch",
    "LAYOUT_HANDOFF": "TPUC_HOST_KERNELS=-handoff",
    "CHANNELS_LAST": "TPUC_HOST_KERNELS=-channels_last",
    "MALLOC": "TPUC_HOST_KERNELS=-malloc (was =default)",
    "DISCRETE_DEVICE": "TPUC_DEBUG=discrete_device",
    "NO_HOST_VIEWS": "TPUC_DEBUG=no_host_views",
    "MODULE_FORMAT": "TPUC_DEBUG=module_format=text (or =bytecode)",
    "SKIP_DEVICE_CHECK": "TPUC_DEBUG=skip_device_check",
    "PROFILE_EVERY": "TPUC_DEBUG=profile_every=N",
    "CACHE_WRITE_PAUSE_MS": "TPUC_DEBUG=cache_write_pause_ms=N",
    "DUMP_SVG_MAX_NODES": "a constant, tpuc.dump.SVG_MAX_NODES (3000; above it, render graph.dot yourself)",
    "DUMP_SVG_TIMEOUT": "a constant, tpuc.dump.SVG_TIMEOUT (20 s)",
    "EXECUTE_SPIN_US": "a constant, tpuc_runtime::EXECUTE_SPIN (100 us); tpuc._native.execute_spin_us(us) sets it for a process",
    "HOST_GEMM_SPIN_US": "a constant, tpuc_hostkernels::spin_helpers::SPIN (1000 us)",
    "HOST_GEMM_PIECES": "a test hook, tpuc._native.set_host_gemm_always_pieces(True)",
    "ONEDNN_TRIALS": "nothing: each convolution runs oneDNN's first-ranked implementation, never one chosen by timing (first_ranked in host_conv.rs)",
    "UNPARTITIONED_MAX": "a constant, UNPARTITIONED_MAX_ELEMENTS in compiler/src/pipeline.rs (2^18); tpuc._native.set_unpartitioned_max(n) sets it for a process",
}

_warned = False
_lock = threading.Lock()


def retired_set() -> list[str]:
    """The retired variables set in this process's environment, with their replacements."""
    return [f"TPUC_{old} (now: {new})" for old, new in RETIRED.items() if ("TPUC_" + old) in os.environ]


def check() -> None:
    """Raises ValueError for a malformed TPUC_HOST_KERNELS or TPUC_DEBUG, and warns (once per
    process) about retired variables that are set. Run before a runtime starts, so that the
    Rust side, which falls back to the defaults on a malformed value, never meets one unsaid."""
    global _warned
    _native.host_kernels(None)
    _native.debug_settings(None)
    with _lock:
        if _warned:
            return
        _warned = True
    stale = retired_set()
    if stale:
        warnings.warn(
            "tpuc: these variables are no longer read and are ignored: " + "; ".join(stale),
            RuntimeWarning,
            stacklevel=3,
        )
