"""The `tpuc` command line."""

from __future__ import annotations

import argparse
import sys


def _doctor(args) -> int:
    import torch

    from . import _native, runtime
    from . import options as options_mod

    print(f"torch {torch.__version__}")
    try:
        path = runtime.resolve_plugin(args.plugin)
    except ValueError as e:
        print(f"plugin: NOT FOUND ({e})")
        return 1
    print(f"plugin: {path}")
    try:
        rt = runtime.get_runtime(str(path))
    except _native.TpucError as e:
        print(f"plugin: failed to load: {e}")
        return 1
    print(f"platform: {rt.platform} {rt.platform_version} (PJRT API {rt.api_version[0]}.{rt.api_version[1]})")
    print(f"devices: {rt.device_count}")
    print(f"cache dir: {options_mod.parse({}).cache_dir}")
    print(f"lowering rules: {len(_native.supported_ops())} ATen ops")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpuc", description="tpuc: torch.compile backend (Rust, StableHLO, PJRT)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the plugin, versions, devices and cache dir")
    doctor.add_argument("--plugin", default=None, help="cpu, cuda, tpu or a path (default: detect)")
    doctor.set_defaults(func=_doctor)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
