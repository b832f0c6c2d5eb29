"""Finding the PJRT plugin and holding one runtime (PJRT client) per plugin per process."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import struct
import threading
from pathlib import Path

from . import _native

_lock = threading.Lock()
_runtimes: dict[tuple[str, int | None], _native.Runtime] = {}

# pip distribution -> the plugin file inside it.
_PLUGIN_WHEELS = {
    "cpu": [("xla-cpu-pjrt", "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")],
    "cuda": [
        ("jax-cuda12-pjrt", "jax_plugins/xla_cuda12/xla_cuda_plugin.so"),
        ("jax-cuda13-pjrt", "jax_plugins/xla_cuda13/xla_cuda_plugin.so"),
    ],
    "tpu": [("libtpu", "libtpu/libtpu.so")],
}


def _installed_plugin(kind: str) -> Path | None:
    for dist, rel in _PLUGIN_WHEELS[kind]:
        try:
            path = Path(importlib.metadata.distribution(dist).locate_file(rel))
        except importlib.metadata.PackageNotFoundError:
            continue
        if path.is_file():
            return path
    return None


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_cuda() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def resolve_plugin(plugin: str | None) -> Path:
    """The plugin file for an option value (`cpu`, `cuda`, `tpu`, a path, or None = detect)."""
    if plugin is None:
        if _has_tpu() and _installed_plugin("tpu"):
            plugin = "tpu"
        elif _has_cuda() and _installed_plugin("cuda"):
            plugin = "cuda"
        else:
            plugin = "cpu"
    if plugin in _PLUGIN_WHEELS:
        path = _installed_plugin(plugin)
        if path is None:
            wheels = ", ".join(d for d, _ in _PLUGIN_WHEELS[plugin])
            raise ValueError(
                f"tpuc: no {plugin} PJRT plugin is installed (pip install --no-deps {wheels}), "
                f"or pass options={{'plugin': '/path/to/plugin.so'}}"
            )
        if plugin == "tpu":
            # Without this, libtpu retries a metadata server for minutes off Google Cloud.
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        return path
    path = Path(plugin).expanduser()
    if not path.is_file():
        raise ValueError(
            f"tpuc: PJRT plugin {str(plugin)!r} does not exist "
            f"(option 'plugin' or TPUC_PJRT_PLUGIN: 'cpu', 'cuda', 'tpu' or a path to a .so)"
        )
    return path.resolve()


def positive_int_env(name: str, default: int) -> int:
    """The environment variable `name` as a positive integer (`default` when unset); anything
    else raises ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"tpuc: {name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"tpuc: {name} must be a positive integer, got {value!r}")
    return n


def cpu_device_count() -> int | None:
    return positive_int_env("TPUC_CPU_DEVICES", 1)


def check_plugin_file(path: Path) -> None:
    """Raises PjrtError when `path` is an ELF shared library cut short: the dynamic loader maps
    the missing part anyway, and the process dies of SIGBUS as soon as it is touched."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
                return  # not a 64-bit little-endian ELF file: the loader gives its own error
            phoff, phentsize, phnum = (
                struct.unpack_from("<Q", header, 32)[0],
                *struct.unpack_from("<HH", header, 54),
            )
            if phentsize < 56 or phoff + phnum * phentsize > size:
                raise _native.PjrtError(
                    f"cannot load PJRT plugin {path}: truncated file ({size} bytes, program headers "
                    f"end at byte {phoff + phnum * phentsize})"
                )
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError as e:
        raise _native.PjrtError(f"cannot load PJRT plugin {path}: {e}") from None
    for k in range(phnum):
        _, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, k * phentsize)
        if offset + filesz > size:
            raise _native.PjrtError(
                f"cannot load PJRT plugin {path}: truncated file ({size} bytes, a segment ends at "
                f"byte {offset + filesz}); reinstall the plugin"
            )


def get_runtime(plugin: str | None, mesh_size: int | None = None) -> _native.Runtime:
    """The process's runtime for `plugin` (created on first use; plugins are never unloaded).
    With a mesh and TPUC_CPU_DEVICES unset, the CPU plugin gets one device per mesh device."""
    path = resolve_plugin(plugin)
    devices = cpu_device_count()
    if mesh_size is not None and os.environ.get("TPUC_CPU_DEVICES") is None:
        devices = max(devices, mesh_size)
    # XLA logs informational lines to stderr at plugin start; keep them unless asked for.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    key = (str(path), devices)
    with _lock:
        rt = _runtimes.get(key)
        if rt is None:
            check_plugin_file(path)
            rt = _native.Runtime(str(path), devices)
            _runtimes[key] = rt
        return rt
