"""Validation of `torch.compile(..., options={...})` (docs/api.md, "Options", is the contract)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import target_spec

VALID_KEYS = (
    "plugin",
    "precision",
    "cache_dir",
    "dump_dir",
    "fallback",
    "buckets",
    "mesh",
    "sharding",
    "passes",
    "plugin_options",
    "residency",
    "target",
    "stand_in",
    "regions",
)
RESIDENCIES = ("auto", "versioned", "off")
#: How blocks marked `@torch.compiler.nested_compile_region` compile (regions.py).
REGIONS = ("auto", "executables", "inline", "loop")
PRECISIONS = ("highest", "high", "default")
FALLBACKS = ("eager", "error")
SHARDINGS = ("replicated", "data_parallel", "fsdp", "tensor_parallel")
#: Pass groups a `passes` option may switch as a whole (each pass's own name works too).
PASSES = ("cleanup", "fusion")


def pipeline() -> list[tuple[str, str, str]]:
    """The IR passes in the fixed order they run: `[(name, group, description)]`."""
    from . import _native

    return [tuple(p) for p in _native.FxGraph.passes()]


#: The FX preparation steps in the order they run (prepare.py's table, which checks it holds
#: exactly these): `options["passes"]` switches them too, for debugging.
PREPARE_STEPS = (
    "flex_attention",
    "mutations",
    "input_views",
    "checks",
    "storage_rebase",
    "ties",
    "block_loops",
    "inline_regions",
)


def pass_names() -> tuple[str, ...]:
    """Every name `options["passes"]` accepts: the groups, then each pass in pipeline order,
    then the FX preparation steps."""
    return PASSES + tuple(name for name, _group, _doc in pipeline()) + PREPARE_STEPS


DEFAULT_CACHE_MAX_SIZE = "10G"

# torch.get_float32_matmul_precision() -> our precision.
_TORCH_PRECISION = {"highest": "highest", "high": "high", "medium": "default"}


@dataclass(frozen=True)
class Options:
    plugin: str | None = None
    precision: str = "highest"
    cache_dir: Path | None = None
    dump_dir: Path | None = None
    fallback: str = "eager"
    buckets: Any = "pow2"
    mesh: dict | None = None
    sharding: Any = "replicated"
    passes: dict = field(default_factory=dict)
    cache_max_bytes: int | None = None
    plugin_options: dict = field(default_factory=dict)
    residency: str = "auto"
    #: Devices to compile for instead of running here, e.g. "tpu:v5e:2x2" (targets.py).
    target: str | None = None
    #: With a target: this machine's plugin ("cpu") also runs the target-lowered graphs (road.py).
    stand_in: str | None = None
    regions: str = "auto"

    def pass_enabled(self, name: str) -> bool:
        """Whether pass or group `name` runs: a pass's own entry wins over its group's."""
        group = next((g for n, g, _ in pipeline() if n == name), None)
        return bool(self.passes.get(name, self.passes.get(group, True)))

    def enabled_passes(self) -> list[str]:
        """The pipeline passes that run with these options, in order."""
        return [name for name, _group, _doc in pipeline() if self.pass_enabled(name)]


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"tpuc: bad value for option {key!r}: {value!r} (expected {expected})")


def parse_size(text: str) -> int:
    """`"500M"`, `"10G"`, `"1.5G"`, `"4096"` -> bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in units else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"tpuc: bad size {text!r} (expected e.g. 500M, 10G)") from None
    if value < 0:
        raise ValueError(f"tpuc: bad size {text!r} (negative)")
    return int(value * units[unit])


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpuc"


def parse(options: dict | None, mode: str | None = None) -> Options:
    """Checks `options` and fills defaults from the environment and torch's settings."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"tpuc: options must be a dict of {{key: value}}, got {type(options).__name__}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(VALID_KEYS))
    if unknown:
        raise ValueError(f"tpuc: unknown option(s) {unknown}; valid keys are: {', '.join(VALID_KEYS)}")

    plugin = options.get("plugin", os.environ.get("TPUC_PJRT_PLUGIN") or None)
    if plugin is not None and not isinstance(plugin, str | os.PathLike):
        raise _bad("plugin", plugin, '"cpu", "cuda", "rocm", "tpu" or a path to a PJRT plugin .so')
    plugin_options = options.get("plugin_options") or {}
    if not isinstance(plugin_options, dict) or not all(
        isinstance(k, str)
        and (
            isinstance(v, bool | int | float | str)
            or (
                isinstance(v, list | tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            )
        )
        for k, v in plugin_options.items()
    ):
        raise _bad(
            "plugin_options",
            plugin_options,
            "a dict of PJRT_Client_Create options {name: bool | int | float | str | list of ints}",
        )

    residency = options.get("residency", os.environ.get("TPUC_RESIDENCY") or "auto")
    if residency not in RESIDENCIES:
        raise _bad("residency", residency, " or ".join(repr(r) for r in RESIDENCIES))

    regions = options.get("regions", "auto")
    if regions not in REGIONS:
        raise _bad("regions", regions, " or ".join(repr(r) for r in REGIONS))

    if "precision" in options:
        precision = options["precision"]
        if precision not in PRECISIONS:
            raise _bad("precision", precision, " or ".join(repr(p) for p in PRECISIONS))
    else:
        precision = _TORCH_PRECISION.get(torch.get_float32_matmul_precision(), "highest")

    if "cache_dir" in options:
        cache_dir = options["cache_dir"]
        if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
            raise _bad("cache_dir", cache_dir, "a folder path or None")
    else:
        cache_dir = os.environ.get("TPUC_CACHE_DIR") or default_cache_dir()

    dump_dir = options.get("dump_dir", os.environ.get("TPUC_DUMP_DIR") or None)
    if dump_dir is not None and not isinstance(dump_dir, str | os.PathLike):
        raise _bad("dump_dir", dump_dir, "a folder path or None")

    fallback = options.get("fallback", "eager")
    if fallback not in FALLBACKS:
        raise _bad("fallback", fallback, " or ".join(repr(f) for f in FALLBACKS))

    buckets = options.get("buckets", "pow2")
    if not (
        buckets == "pow2"
        or (
            isinstance(buckets, list | tuple)
            and buckets
            and all(isinstance(b, int) and b > 0 for b in buckets)
        )
    ):
        raise _bad("buckets", buckets, '"pow2" or a non-empty list of positive ints')

    mesh = options.get("mesh")
    if mesh is not None:
        if not (
            isinstance(mesh, dict)
            and set(mesh) <= {"shape", "axes"}
            and isinstance(mesh.get("shape"), list | tuple)
            and all(isinstance(s, int) and s > 0 for s in mesh["shape"])
            and isinstance(mesh.get("axes"), list | tuple)
            and len(mesh["axes"]) == len(mesh["shape"])
        ):
            raise _bad("mesh", mesh, '{"shape": [ints], "axes": [names]} with one name per dim')

    sharding = options.get("sharding", "replicated")
    if not (sharding in SHARDINGS or isinstance(sharding, dict | list | tuple)):
        raise _bad("sharding", sharding, " or ".join(repr(s) for s in SHARDINGS) + " or per-input specs")

    passes = options.get("passes", {})
    valid = pass_names()
    if not isinstance(passes, dict) or not all(isinstance(v, bool) for v in passes.values()):
        raise _bad("passes", passes, f"a dict of {{name: bool}} with names from: {', '.join(valid)}")
    unknown = sorted(str(k) for k in passes if k not in valid)
    if unknown:
        raise ValueError(
            f"tpuc: bad value for option 'passes': {passes!r} (unknown pass(es) {unknown}; "
            f"valid names are: {', '.join(valid)})"
        )

    target = options.get("target")
    if target is not None:
        target = target_spec.parse(target).name
    stand_in = options.get("stand_in")
    if stand_in is not None and not isinstance(stand_in, str):
        raise _bad(
            "stand_in", stand_in, "\"cpu\" (this machine's plugin that runs a target's graphs) or None"
        )
    if stand_in is not None and target is None:
        raise ValueError(
            "tpuc: option 'stand_in' runs a target's graphs on this machine: it needs option 'target' "
            "(e.g. {'target': 'tpu:v5e:2x2', 'stand_in': 'cpu'})"
        )

    return Options(
        target=target,
        stand_in=stand_in,
        plugin=str(plugin) if plugin is not None else None,
        precision=precision,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
        fallback=fallback,
        buckets=list(buckets) if isinstance(buckets, list | tuple) else buckets,
        mesh=mesh,
        sharding=sharding,
        passes=dict(passes),
        residency=residency,
        regions=regions,
        plugin_options={k: list(v) if isinstance(v, list | tuple) else v for k, v in plugin_options.items()},
        cache_max_bytes=parse_size(os.environ.get("TPUC_CACHE_MAX_SIZE") or DEFAULT_CACHE_MAX_SIZE),
    )
