"""tpuc's compiled graphs in PyTorch's own caches (AOTAutogradCache and the portable cache
artifacts of `torch.compiler.save_cache_artifacts()` / `load_cache_artifacts()`).

AOTAutograd caches a custom backend's graphs when they are `OutputCode` that can be pickled and
its bundled mode is on: tpuc's backend then hands AOTAutograd a `TpucOutputCode` per graph (as for
AOT precompile, saved.py), holding the graph before tpuc's compile and the bytes of the
executables it compiled (the entries of tpuc's disk cache). A later `torch.compile` of the same
graph, in this process or another one that shares the cache folder or loaded the artifacts, skips
AOTAutograd's trace: tpuc imports and lowers the saved graph again, and finds each executable in
its disk cache, where loading the entry put it (no XLA compile, even with an empty tpuc cache).

A graph loaded this way runs without two refinements of a fresh compile (AOTAutograd's runtime
wrapper stays in front of an inference graph, and activations saved for the backward keep the
row-major layout); both change speed, not results.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import os
import tempfile
from pathlib import Path

import torch

from .version import __version__

# The cache keys of the executables obtained while one graph compiles (regions included).
_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("tpuc_exe_keys", default=None)
# The parsed options of the torch.compile under way: a graph loaded from AOTAutograd's cache
# compiles with them (its key names the same options).
_live: contextvars.ContextVar = contextvars.ContextVar("tpuc_live_options", default=None)


def live_options():
    return _live.get()


def enabled(opts, mesh) -> bool:
    """Whether this compile goes through AOTAutograd's cache: PyTorch's switches
    (`torch._functorch.config.enable_autograd_cache`, `torch.compiler.config.force_disable_caches`)
    allow it, tpuc's own cache is on (`cache_dir`), and there is no mesh (sharded graphs are not
    saved yet).

    Why not with `cache_dir=None`: the first cache key of a process costs 2.6-5.8 s on a loaded
    2-core host (PyTorch's `autograd_cache_key` imports and hashes much of Inductor and torch's
    sources; later keys of the process 0.04-0.14 s; GPT-2 124M, docs/pytorch-caches.md), and an
    entry would carry no executables; a compile that asked for no cache does not pay for one."""
    from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache

    return mesh is None and opts.cache_dir is not None and should_use_local_autograd_cache()


@contextlib.contextmanager
def caching(opts, mode, maxima: dict):
    """AOTAutograd's bundled cache for tpuc's graphs, with a key that also names tpuc's version,
    its options and the declared maxima (which shape the graph and its buckets)."""
    maxima_text = sorted((str(s), m) for s, (m, _) in maxima.items())
    # Where executables and dumps go does not change what compiles (a process that loaded the
    # artifacts has another cache folder).
    compiling = dataclasses.replace(opts, cache_dir=None, dump_dir=None, cache_max_bytes=None)
    from . import handoff

    # The layouts a forward hands its backward are in the entry (saved.py): the switch too.
    tag = (
        f"tpuc {__version__} {_code_identity()} {compiling!r} mode={mode!r} maxima={maxima_text} "
        f"handoff={handoff.enabled()}"
    )
    user_tag = torch.compiler.config.cache_key_tag
    token = _live.set(opts)
    try:
        with (
            # The backward compiles with the forward: its entry is saved while the patch holds.
            torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True),
            torch.compiler.config.patch(cache_key_tag=f"{user_tag}|{tag}" if user_tag else tag),
        ):
            yield
    finally:
        _live.reset(token)


# The modules that decide what AOTAutograd traces for tpuc, read as files (importing the backend
# here would import this module back).
_TRACING_CODE = ("backend.py", "decompositions.py")


@functools.cache
def _code_identity() -> str:
    """A digest of the code that decides what AOTAutograd traces for tpuc (the backend's
    decompositions and tracing choices) and of the native module's build: a changed tpuc
    never loads graphs another one traced."""
    from . import _native

    h = hashlib.sha256()
    for name in _TRACING_CODE:
        h.update((Path(__file__).parent / name).read_bytes())
    st = Path(_native.__file__).stat()
    h.update(f"{st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def collecting(keys: list):
    """Records in `keys` the cache key of every executable obtained inside the block."""
    token = _collector.set(keys)
    try:
        yield
    finally:
        _collector.reset(token)


def record(exe) -> None:
    keys = _collector.get()
    if keys is not None:
        keys.append(exe.key)


_SUFFIX = ".tpuc"  # tpuc's disk cache entry: `<key hex>.tpuc` (cache/src/disk.rs)


def read_entries(keys: list[str], cache_dir) -> dict[str, bytes]:
    """The disk cache entries (whole files, checksummed) of `keys` found in `cache_dir`."""
    out = {}
    if cache_dir is None:
        return out
    for key in dict.fromkeys(keys):
        try:
            out[key] = (Path(cache_dir) / f"{key}{_SUFFIX}").read_bytes()
        except OSError:
            pass  # not stored (no disk cache when it compiled, or evicted): compiled on load
    return out


def install_entries(entries: dict[str, bytes], cache_dir) -> None:
    """Writes the entries that `cache_dir` lacks, each whole or not at all (temp file and
    rename, as the disk cache does). The cache checks every entry when it reads it."""
    if cache_dir is None or not entries:
        return
    folder = Path(cache_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for key, data in entries.items():
        if not all(c in "0123456789abcdef" for c in key):
            continue  # not a key: never a path of our choosing
        path = folder / f"{key}{_SUFFIX}"
        if path.exists():
            continue
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
