"""tpuc: a `torch.compile` backend written in Rust.

    compiled = torch.compile(model, backend="tpu")

`import tpuc` is not needed for that (the backend is registered as an entry point); import it
for `tpuc.stats()`, `tpuc.reset_stats()`, the error types, `tpuc.precompile` and
`tpuc.save_compiled` / `tpuc.load_compiled` (a compiled model in a file, loaded without tracing).
"""

from ._native import GraphImportError, PjrtError, ShardingError, TpucError, UnsupportedOpError, supported_ops
from .counters import reset_stats, stats
from .version import __version__ as __version__

__all__ = [
    "GraphImportError",
    "PjrtError",
    "precompile",
    "resident_bytes",
    "load_compiled",
    "save_compiled",
    "ShardingError",
    "TargetUnavailableError",
    "DeviceMemoryError",
    "TpucError",
    "UnsupportedOpError",
    "reset_stats",
    "stats",
    "supported_ops",
]


def __getattr__(name):
    # `precompile` needs torch; importing it lazily keeps `import tpuc` (and the cache CLI) light.
    if name == "precompile":
        from .precompiler import precompile

        return precompile
    if name in ("save_compiled", "load_compiled"):
        from . import saved

        return getattr(saved, name)
    if name in ("TargetUnavailableError", "DeviceMemoryError"):
        from . import targets

        return getattr(targets, name)
    if name == "resident_bytes":
        from .sharding import resident_bytes

        return resident_bytes
    raise AttributeError(f"module 'tpuc' has no attribute {name!r}")
