"""The `tpuc` command line."""

from __future__ import annotations

import argparse
import sys


def _doctor(args) -> int:
    import os

    import torch

    from . import _native, runtime
    from . import options as options_mod

    print(f"torch {torch.__version__}")
    print("installed plugins:")
    for family, found in runtime.installed_plugins().items():
        present = "present" if runtime.hardware_present(family) else "absent"
        if family == "tpu":
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # loading it must not wait
        try:
            major, minor = _native.plugin_api_version(str(found))
            api = f"PJRT API {major}.{minor}"
        except _native.TpucError as e:
            api = f"does not load: {e}"
        print(f"  {family}: {found} ({api}, hardware {present})")
    plugin = args.plugin or os.environ.get("TPUC_PJRT_PLUGIN") or None
    source = "--plugin" if args.plugin else "TPUC_PJRT_PLUGIN" if plugin else "detected"
    try:
        path = runtime.resolve_plugin(plugin)
    except ValueError as e:
        print(f"plugin: NOT FOUND ({e})")
        return 1
    family = runtime.plugin_family(path, plugin)
    print(f"plugin ({source}): {path} (family {family})")
    try:
        rt = runtime.get_runtime(plugin)
    except _native.TpucError as e:
        print(f"plugin: failed to start: {e}")
        return 1
    print(f"platform: {rt.platform} {rt.platform_version} (PJRT API {rt.api_version[0]}.{rt.api_version[1]})")
    if rt.stablehlo_versions is not None:
        current, minimum = (".".join(map(str, v)) for v in rt.stablehlo_versions)
        print(f"StableHLO: {minimum} to {current} accepted; modules sent as MLIR {rt.module_format}")
    print(f"devices: {rt.device_count}")
    if family == "cpu":
        macs = rt.host_gemm_min_macs
        host = (
            f"PyTorch's MKL for f32 products of >= {macs} multiply-adds"
            if macs
            else "off (TPUC_HOST_KERNELS without gemm, or PyTorch here has no MKL)"
        )
        print(f"host BLAS: {host}")
        version = _native.Runtime.host_conv_version()
        conv = (
            f"oneDNN {'.'.join(map(str, version or ()))} for 2-D f32 convolutions"
            if rt.host_conv
            else "off (TPUC_HOST_KERNELS without conv, or no oneDNN here: PyPI onednn-cpu-gomp or apt libdnnl2)"
        )
        print(f"host convolutions: {conv}")
        if not rt.host_rows:
            rows = "off (TPUC_HOST_KERNELS without rows, or the plugin has no FFI extension)"
        elif rt.host_attention:
            rows = "tpuc's kernels for large f32 layer norms and CPU flash attention"
        else:
            rows = "tpuc's kernel for large f32 layer norms (attention needs the host BLAS)"
        print(f"host row kernels: {rows}")
        from . import conformance

        report = conformance.check(rt, options_mod.parse({}).cache_dir, full=args.full_math)
        how = "kept result" if report.cached else f"ran in {report.seconds:.1f} s"
        print(f"known-answer check of the plugin's math ({report.ops} ops; {how}):")
        if not report.wrong:
            print("  every op matches PyTorch")
        for op, where in sorted(report.wrong.items()):
            fixed = "tpuc's own expansion from now on" if op in report.repaired else "NOT REPAIRED"
            print(f"  WRONG {conformance.describe(op, where)} -> {fixed}")
    print(f"cache dir: {options_mod.parse({}).cache_dir}")
    ops = _native.supported_ops()
    kinds = {k: sum(o.startswith(k + ".") for o in ops) for k in ("aten", "prims", "higher_order")}
    print(
        f"lowering rules: {kinds['aten']} ATen ops, {kinds['prims']} prims, "
        f"{kinds['higher_order']} control-flow operators"
    )
    return 0


def _cache_dir(args) -> str:
    from . import options as options_mod

    return str(args.cache_dir or options_mod.parse({}).cache_dir)


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _cache(args) -> int:
    import datetime

    from . import _native
    from . import options as options_mod

    d = _cache_dir(args)
    if args.action == "ls":
        entries = _native.cache_list(d)
        for key, size, used in entries:
            try:
                target = _native.cache_entry_target(d, key) or "?"
            except _native.TpucError:
                target = "unreadable"
            print(
                f"{key}  {_human(size):>7}  {datetime.datetime.fromtimestamp(used):%Y-%m-%d %H:%M:%S}  {target}"
            )
        print(f"{len(entries)} entries, {_human(sum(e[1] for e in entries))} in {d}")
    elif args.action == "info":
        if not args.key:
            print("tpuc cache info: give a KEY (see tpuc cache ls)", file=sys.stderr)
            return 2
        info = dict(_native.cache_info(d, args.key))
        info["target"] = _native.cache_entry_target(d, args.key) or "?"
        for k, v in sorted((_native.cache_entry_report(d, args.key) or {}).items()):
            info.setdefault(k, v)
        for k, v in sorted(info.items()):
            print(f"{k}: {v}")
    elif args.action == "verify":
        good, bad = _native.cache_verify(d)
        for path, reason in bad:
            print(f"removed {path}: {reason}")
        print(f"{good} good, {len(bad)} bad entries in {d}")
        return 1 if bad else 0
    elif args.action == "gc":
        if not args.max_size:
            print("tpuc cache gc: give --max-size (e.g. 2G)", file=sys.stderr)
            return 2
        r = _native.cache_gc(d, options_mod.parse_size(args.max_size))
        print(
            f"removed {r['removed']} entries ({_human(r['freed_bytes'])}), kept {r['kept']} "
            f"({_human(r['kept_bytes'])}), removed {r['stale_temp_files']} stale temp files"
        )
    elif args.action == "clear":
        print(f"removed {_native.cache_clear(d)} entries from {d}")
    return 0


def _precompile(args) -> int:
    import importlib
    import json
    import os

    from .precompiler import precompile

    module_name, _, factory_name = args.target.partition(":")
    if not factory_name:
        print("tpuc precompile: expected MODULE:FACTORY", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())
    factory = getattr(importlib.import_module(module_name), factory_name)
    model, example_inputs, dynamic = factory()
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    options = {"cache_dir": args.cache_dir}
    if args.device_target:
        options["target"] = args.device_target
    report = precompile(
        model,
        example_inputs,
        dynamic=dynamic,
        buckets=buckets,
        options=options,
        progress=True,
        training="step" if args.step else args.training,
    )
    if args.device_target:
        from . import targets

        print(f"target {report['target']}: {report['executables']} executables in {report['seconds']:.1f} s")
        print("\n".join(targets.table(report["per_graph"])))
        return 0
    print(json.dumps(report, indent=2))
    return 0


def _dump(args) -> int:
    from . import dump

    try:
        if args.diff:
            if len(args.dirs) != 2:
                print("tpuc dump --diff: give two dump folders (or two graph folders): A B", file=sys.stderr)
                return 2
            lines, _ = dump.diff(*args.dirs)
        elif args.lines:
            if len(args.dirs) != 1:
                print("tpuc dump --lines: give one dump folder", file=sys.stderr)
                return 2
            lines = dump.by_line(args.dirs[0], top=args.top)
        else:
            if len(args.dirs) != 1:
                print("tpuc dump: give one dump folder (or --diff A B)", file=sys.stderr)
                return 2
            lines = dump.summarize(args.dirs[0], top=args.top)
    except dump.NotADump as e:
        print(f"tpuc dump: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _graph_diff(args) -> int:
    import importlib
    import os

    import torch

    from . import graph_diff

    module_name, _, factory_name = args.target.partition(":")
    if not factory_name:
        print("tpuc graph-diff: expected MODULE:FACTORY", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())
    model, call_args = getattr(importlib.import_module(module_name), factory_name)()
    if isinstance(call_args, torch.Tensor):
        call_args = (call_args,)
    graph_diff.compare(
        model,
        tuple(call_args),
        threshold=args.threshold,
        locate_call=args.locate,
        at=tuple(args.at) if args.at else None,
        show=args.show,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpuc", description="tpuc: torch.compile backend (Rust, StableHLO, PJRT)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the plugin, versions, devices and cache dir")
    doctor.add_argument(
        "--plugin",
        default=None,
        help="cpu, cuda, rocm, tpu or a path (default: TPUC_PJRT_PLUGIN, else detect)",
    )
    doctor.add_argument(
        "--full-math",
        action="store_true",
        help="run the plugin's known-answer check at every size (1 to 4099) and in bfloat16 too, afresh",
    )
    doctor.set_defaults(func=_doctor)

    cache = sub.add_parser("cache", help="inspect and manage the persistent executable cache")
    cache.add_argument("action", choices=["ls", "info", "verify", "gc", "clear"])
    cache.add_argument("key", nargs="?", help="entry key (for info)")
    cache.add_argument("--cache-dir", default=None, help="default: TPUC_CACHE_DIR or ~/.cache/tpuc")
    cache.add_argument("--max-size", default=None, help="for gc: size to shrink to, e.g. 2G")
    cache.set_defaults(func=_cache)

    pre = sub.add_parser("precompile", help="compile a model's shape buckets into the cache ahead of time")
    pre.add_argument(
        "target", metavar="MODULE:FACTORY", help="FACTORY() returns (model, example_inputs, dynamic)"
    )
    pre.add_argument("--cache-dir", required=True)
    pre.add_argument("--buckets", default=None, help="comma-separated sizes (default: powers of two)")
    pre.add_argument(
        "--target",
        dest="device_target",
        default=None,
        help="compile for devices this machine lacks, e.g. tpu:v5e:2x2 (prints memory per chip)",
    )
    pre.add_argument("--training", action="store_true", help="also the backward graphs (one training step)")
    pre.add_argument(
        "--step",
        action="store_true",
        help="the factory's model is a whole training step (zero_grad, forward, backward, opt.step): "
        "one executable, with --target",
    )
    pre.set_defaults(func=_precompile)

    dmp = sub.add_parser("dump", help="summarize a dump folder (dump_dir), or diff two")
    dmp.add_argument("dirs", nargs="+", metavar="DIR", help="a dump folder or one graph folder in it")
    dmp.add_argument("--diff", action="store_true", help="compare two dumps: tpuc dump --diff A B")
    dmp.add_argument(
        "--lines",
        action="store_true",
        help="per user source line: the StableHLO ops and XLA instructions it became",
    )
    dmp.add_argument("--top", type=int, default=5, help="op kinds shown per graph (default 5)")
    dmp.set_defaults(func=_dump)

    gd = sub.add_parser(
        "graph-diff",
        help="where a compiled model leaves eager: per Dynamo graph, then per op (tpuc.graph_diff)",
    )
    gd.add_argument(
        "target", metavar="MODULE:FACTORY", help="FACTORY() returns (model, args): one call's arguments"
    )
    gd.add_argument("--locate", action="store_true", help="per op of the first call beyond --threshold")
    gd.add_argument("--threshold", type=float, default=None, help="default: 1e-5 (float32), 1e-12 (float64)")
    gd.add_argument("--at", nargs=2, type=int, metavar=("GRAPH", "CALL"), help="locate this call instead")
    gd.add_argument("--show", type=int, default=40, help="rows of the per-op table (default 40)")
    gd.set_defaults(func=_graph_diff)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, PermissionError, RuntimeError) as e:
        print(f"tpuc: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
