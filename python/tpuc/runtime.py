"""Finding the PJRT plugin and holding one runtime (PJRT client) per plugin per process."""

from __future__ import annotations

import atexit
import glob
import importlib.metadata
import os
import struct
import sys
import threading
import warnings
from pathlib import Path

from . import _native, env, host_malloc

_lock = threading.Lock()
_runtimes: dict[tuple, _native.Runtime] = {}
_exit_hook = []  # [True] once `_at_exit` is registered

# How long tpuc's atexit hook waits, at most, for other threads to leave tpuc's GIL-free sections
# and for the host kernels' helper threads to end (it never waits longer: never a hang at exit).
EXIT_WAIT_S = 10.0


def _at_exit() -> dict:
    """tpuc's part of the interpreter's exit, an atexit hook registered with the first runtime
    (docs/reliability-and-testing.md, "A clean exit"): from here on a thread other than the
    exiting one never takes the GIL back inside tpuc (it parks; CPython 3.11 would end it with
    `pthread_exit` during finalization, which aborts the process in native frames), the host
    kernels' helper threads are joined, and the runtimes' PJRT clients are kept alive to the end
    of the process instead of being destroyed wherever the final collection frees them."""
    # No lock: a thread parked inside tpuc may hold `_lock` (a runtime being created).
    return dict(_native.begin_exit(list(_runtimes.values()), EXIT_WAIT_S))


# Another CPU plugin on PyPI (a newer XLA build), chosen by its wheel's name as the plugin:
# options={"plugin": "fastatomstruct-xla-cpu"}. tpuc's bytecode and the zoo were checked on it
# (bench/results/plugins.md).
_OTHER_CPU_WHEELS = {
    "fastatomstruct-xla-cpu": "fastatomstruct_xla_cpu/libpjrt_cpu.so",
}

# pip distribution -> the plugin file inside it; a family's first installed wheel is its plugin.
# The CPU's default is the newest XLA build on PyPI when installed (scripts/setup.sh installs it;
# pip: the `fast-cpu` extra): GPT-2 124M ran in half the time of the older build, which stays a
# dependency as the fallback (docs/plugins-and-targets.md, bench/results/plugins.md).
_PLUGIN_WHEELS = {
    "cpu": [
        ("lammps-jax-pjrt-cpu", "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"),
        ("xla-cpu-pjrt", "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"),
    ],
    "cuda": [
        ("jax-cuda12-pjrt", "jax_plugins/xla_cuda12/xla_cuda_plugin.so"),
        ("jax-cuda13-pjrt", "jax_plugins/xla_cuda13/xla_cuda_plugin.so"),
    ],
    "rocm": [("jax-rocm7-pjrt", "jax_plugins/xla_rocm7/xla_rocm_plugin.so")],
    "tpu": [("libtpu", "libtpu/libtpu.so")],
}

# What each family's hardware is called in errors, and where its device files are.
_HARDWARE = {
    "cuda": ("an NVIDIA GPU", "/dev/nvidia0 ..."),
    "rocm": ("an AMD GPU", "/dev/kfd"),
    "tpu": ("a TPU", "/dev/accel* or /dev/vfio/*"),
}


def _wheel_file(dist: str, rel: str) -> Path | None:
    """The file `rel` of installed distribution `dist`, or None."""
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(rel))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _installed_plugin(kind: str) -> Path | None:
    return next((p for dist, rel in _PLUGIN_WHEELS[kind] if (p := _wheel_file(dist, rel))), None)


def installed_plugins() -> dict[str, Path]:
    """Each plugin family with a plugin installed from its wheel: {family: path}."""
    found = {kind: _installed_plugin(kind) for kind in _PLUGIN_WHEELS}
    return {kind: path for kind, path in found.items() if path is not None}


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_cuda() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _has_rocm() -> bool:
    return os.path.exists("/dev/kfd")


def hardware_present(family: str) -> bool:
    """Whether this machine has the devices a plugin family needs (the CPU always)."""
    check = {"cuda": _has_cuda, "rocm": _has_rocm, "tpu": _has_tpu}.get(family)
    return check() if check is not None else True


def plugin_family(path: Path, given: str | None = None) -> str:
    """`cpu`, `cuda`, `rocm`, `tpu` or `unknown` for the plugin at `path` (`given`: the option's
    value, a family name or the path as the user spelled it, before links were resolved), from
    the file's name: known before the library is loaded, since loading libtpu off a TPU host is
    what must never happen."""
    if given in _PLUGIN_WHEELS:
        return given
    named = plugin_family(Path(given)) if given is not None else "unknown"
    if named != "unknown":
        return named
    name = path.name.lower()
    for kind, wheels in _PLUGIN_WHEELS.items():
        if any(Path(rel).name == path.name for _dist, rel in wheels):
            return kind
    if name.startswith("libtpu"):
        return "tpu"
    for kind in ("cuda", "rocm", "cpu"):
        if kind in name:
            return kind
    return "unknown"


def resolve_plugin(plugin: str | None) -> Path:
    """The plugin file for an option value (`cpu`, `cuda`, `rocm`, `tpu`, a plugin wheel's name,
    a path, or None = detect: a family is only picked where its hardware is present)."""
    if plugin is None:
        plugin = next(
            (k for k in ("tpu", "cuda", "rocm") if hardware_present(k) and _installed_plugin(k)), "cpu"
        )
    wheel = next(((d, rel) for wheels in _PLUGIN_WHEELS.values() for d, rel in wheels if d == plugin), None)
    wheel = wheel or ((plugin, _OTHER_CPU_WHEELS[plugin]) if plugin in _OTHER_CPU_WHEELS else None)
    if wheel is not None:
        path = _wheel_file(*wheel)
        if path is None:
            raise ValueError(
                f"tpuc: the PJRT plugin wheel {plugin} is not installed (pip install --no-deps {plugin})"
            )
        return path
    if plugin in _PLUGIN_WHEELS:
        path = _installed_plugin(plugin)
        if path is None:
            wheels = ", ".join(d for d, _ in _PLUGIN_WHEELS[plugin])
            raise ValueError(
                f"tpuc: no {plugin} PJRT plugin is installed (pip install --no-deps {wheels}), "
                f"or pass options={{'plugin': '/path/to/plugin.so'}}"
            )
        return path
    path = Path(plugin).expanduser()
    if not path.is_file():
        raise ValueError(
            f"tpuc: PJRT plugin {str(plugin)!r} does not exist "
            f"(option 'plugin' or TPUC_PJRT_PLUGIN: 'cpu', 'cuda', 'rocm', 'tpu' or a path to a .so)"
        )
    return path.resolve()


def check_hardware(path: Path, family: str) -> None:
    """Raises PjrtError naming the missing device when `path`'s family needs hardware this machine
    lacks: a GPU plugin fails slowly and obscurely without one, and libtpu waits minutes for a
    metadata server. TPUC_DEBUG=skip_device_check skips it (device files elsewhere)."""
    if family not in _HARDWARE or env.debug("skip_device_check"):
        return
    if not hardware_present(family):
        what, files = _HARDWARE[family]
        raise _native.PjrtError(
            f"the {family} PJRT plugin {path} needs {what}, and this machine has none (no {files}); "
            "use options={'plugin': 'cpu'} or leave 'plugin' unset to pick what is present"
        )


def create_options(family: str, devices: int | None, overrides: dict | None = None) -> dict:
    """`PJRT_Client_Create` options for a plugin family: only names the family's plugin accepts
    (each plugin rejects the others). CPU: its device count, and synchronous calls when it is one.
    CUDA/ROCm: no preallocation (torch's allocator shares the GPU). TPU and unknown plugins: none.
    `overrides` (option 'plugin_options') are added last, as given."""
    options: dict = {}
    if family == "cpu" and devices is not None:
        options["cpu_device_count"] = devices
    if family == "cpu" and devices in (None, 1):
        # Run each call on the calling thread, not handed to XLA's pool: its temporaries then
        # come from the caller's malloc arena (host_malloc keeps that one's memory), where a pool
        # thread may have inherited another arena, whose blocks over 64 MiB glibc maps afresh
        # every call. Several devices keep the pool: their partitions must run concurrently.
        options["asynchronous"] = False
    elif family in ("cuda", "rocm"):
        options["preallocate"] = False
    options.update(overrides or {})
    return options


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


def get_runtime(
    plugin: str | None,
    mesh_size: int | None = None,
    plugin_options: dict | None = None,
    lower_for: str | None = None,
) -> _native.Runtime:
    """The process's runtime for `plugin` (created on first use; plugins are never unloaded).
    With a mesh and TPUC_CPU_DEVICES unset, the CPU plugin gets one device per mesh device.
    `lower_for`: a family ("tpu") whose lowering rules the modules follow: a target's stand-in
    (road.py), which runs what the target would, so with no host kernels."""
    path = resolve_plugin(plugin)
    family = plugin_family(path, plugin)
    devices = cpu_device_count()
    if mesh_size is not None and os.environ.get("TPUC_CPU_DEVICES") is None:
        devices = max(devices, mesh_size)
    if family == "tpu":
        # Without this, libtpu retries a metadata server for minutes off Google Cloud.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # XLA logs informational lines to stderr at plugin start; keep them unless asked for.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    options = create_options(family, devices, plugin_options)
    key = (str(path), tuple(sorted((k, repr(v)) for k, v in options.items())), lower_for)
    with _lock:
        rt = _runtimes.get(key)
        if rt is None:
            env.check()
            check_hardware(path, family)
            check_plugin_file(path)
            if family == "cpu":
                # Before the client exists, so that XLA's threads start on the tuned heap.
                host_malloc.tune_for_xla_cpu()
            try:
                rt = _native.Runtime(str(path), options, lower_for)
            except _native.PjrtError as e:
                raise _native.PjrtError(_plain_start_error(str(e), path, family)) from None
            if family == "cpu" and lower_for is None:
                _enable_host_gemm(rt)
                _enable_host_conv(rt)
                _enable_host_rows(rt)
            if family == "cpu":
                # The plugin's math against PyTorch, once per plugin build and CPU (conformance.py);
                # a stand-in too: its results are this plugin's math.
                from . import conformance

                conformance.run_for(rt)
            _runtimes[key] = rt
            if not _exit_hook:
                # Registered after torch's imports, so it runs before their hooks (last in,
                # first out) and before the interpreter starts finalizing.
                atexit.register(_at_exit)
                _exit_hook.append(True)
        return rt


# f32 matrix products of at least this many multiply-adds run in the host BLAS (see
# `_enable_host_gemm`); smaller ones stay in XLA, fused with their neighbours.
HOST_GEMM_MIN_MACS = 1 << 18


def _enable_host_gemm(rt: _native.Runtime) -> None:
    """Lets large f32 matrix products run in the BLAS PyTorch itself
    calls (MKL in its x86 wheels), as XLA FFI custom calls inside the compiled program, where
    MKL was measured faster than XLA's dot (docs/host-kernels.md, "Host BLAS"). Only where that BLAS is MKL;
    `TPUC_HOST_KERNELS=-gemm` keeps every product in XLA."""
    if not env.host_kernel("gemm"):
        return
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if lib.is_file():
        rt.enable_host_gemm(str(lib), HOST_GEMM_MIN_MACS)


# oneDNN with the OpenMP runtime: 3.x from the environment's `lib` (PyPI's onednn-cpu-gomp, which
# scripts/setup.sh installs: its brgemm backward convolutions are faster), else 2.x (Debian's
# libdnnl2), found by the loader's search.
HOST_CONV_LIBRARY_3 = Path(sys.prefix) / "lib" / "libdnnl.so.3"
HOST_CONV_LIBRARY_2 = "libdnnl.so.2"


def host_conv_library() -> str:
    """The oneDNN library convolutions are handed to: `TPUC_ONEDNN` (a path, or a name the loader
    searches for) where set, else 3.x where installed, else 2.x."""
    chosen = os.environ.get("TPUC_ONEDNN")
    if chosen:
        return chosen
    return str(HOST_CONV_LIBRARY_3) if HOST_CONV_LIBRARY_3.is_file() else HOST_CONV_LIBRARY_2


def _enable_host_conv(rt: _native.Runtime) -> None:
    """Lets 2-D f32 convolutions run in oneDNN, the library PyTorch's own CPU convolutions use,
    as XLA FFI custom calls inside the compiled program (XLA's CPU convolutions are Eigen's,
    measured slower: docs/host-kernels.md, "Host oneDNN"). Where oneDNN is missing, convolutions stay in XLA;
    `TPUC_HOST_KERNELS=-conv` keeps them there."""
    if not env.host_kernel("conv"):
        return
    library = host_conv_library()
    if not rt.enable_host_conv(library) and os.environ.get("TPUC_ONEDNN"):
        # Named by the user: say so, where the default's absence only means XLA's convolutions.
        warnings.warn(
            f"tpuc: TPUC_ONEDNN={library} could not be used (missing, a dependency missing, or not"
            " oneDNN 2.x/3.x with OpenMP; TPUC_LOG=tpuc_runtime=debug says which): convolutions"
            " run in XLA",
            RuntimeWarning,
            stacklevel=2,
        )


def _enable_host_rows(rt: _native.Runtime) -> None:
    """Lets large f32 layer norms run in tpuc's own row kernels (one pass over memory per row,
    on both cores), as XLA FFI custom calls inside the compiled program: XLA's CPU lowering
    makes five passes (docs/host-kernels.md, "Host row kernels"). `TPUC_HOST_KERNELS=-rows` keeps them
    in XLA."""
    rt.enable_host_rows(env.host_kernel("rows"))


def _plain_start_error(message: str, path: Path, family: str) -> str:
    """A plugin's start-up error, with what it means in plain words where it is a known one."""
    low = message.lower()
    if family in ("cuda", "rocm") and any(
        s in low for s in ("no cuda-capable device", "cuda_error_no_device", "no visible gpu", "no gpu")
    ):
        return f"the {family} PJRT plugin {path} found no usable GPU: {message}"
    if family in ("cuda", "rocm") and any(
        s in low for s in ("libcuda", "cuda driver", "libamdhip", "cannot open shared object")
    ):
        return f"the {family} PJRT plugin {path} cannot find the GPU driver library: {message}"
    if family == "tpu" and any(s in low for s in ("tpu initialization failed", "no jellyfish device")):
        return f"the tpu PJRT plugin {path} found no TPU: {message}"
    if "unexpected option name" in low:
        return (
            f"{message} (the {family} plugin {path} rejects this create option; see option 'plugin_options')"
        )
    return message
