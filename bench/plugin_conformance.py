"""The CPU plugins side by side on correctness first (issue 44): tpuc's full known-answer suite
(tpuc/conformance.py: 29 elementwise and transcendental ops at 1, 17, 64, 1000 and 4099 elements,
float32/float64/bfloat16, edge values) on each installed CPU plugin's own math, and the first-call
seconds of Swin-V2 (timm, random weights, batch 2), the model whose compile once stalled.

    python bench/plugin_conformance.py                # every installed CPU plugin
    python bench/plugin_conformance.py --no-swin      # the math only

Each plugin runs in its own process (a plugin is never unloaded). See docs/plugin-conformance.md."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PLUGINS = ("lammps-jax-pjrt-cpu", "xla-cpu-pjrt", "fastatomstruct-xla-cpu")
SWIN_MODELS = ("swinv2_cr_tiny_ns_224", "swinv2_tiny_window8_256")
# A child that takes longer than this is reported as stalled.
CHILD_TIMEOUT_S = 900


def child(plugin: str, swin: bool) -> dict:
    import torch

    from tpuc import conformance, runtime

    rt = runtime.get_runtime(plugin)
    rt.set_own_math([])  # the plugin's own math, whatever the check at start-up switched
    report = conformance.check(rt, None, full=True)
    out = {
        "plugin": report.plugin,
        "ops": report.ops,
        "seconds": report.seconds,
        "wrong": {op: conformance.describe(op, where) for op, where in report.wrong.items()},
        "repaired": report.repaired,
    }
    if swin:
        import timm

        for name in SWIN_MODELS:
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).eval()
            x = torch.randn(2, 3, *model.default_cfg["input_size"][1:])
            with torch.no_grad():
                want = model(x)
                compiled = torch.compile(model, backend="tpu", options={"plugin": plugin, "cache_dir": None})
                t0 = time.perf_counter()
                got = compiled(x)
                out[name] = {
                    "first_call_s": round(time.perf_counter() - t0, 1),
                    "max_abs_diff": float((got - want).abs().max()),
                }
            torch._dynamo.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plugins", nargs="*", default=list(PLUGINS))
    ap.add_argument("--no-swin", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, not args.no_swin)))
        return 0
    for plugin in args.plugins:
        cmd = [sys.executable, __file__, "--child", plugin] + (["--no-swin"] if args.no_swin else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(json.dumps({"plugin": plugin, "error": f"stalled: no result in {CHILD_TIMEOUT_S} s"}))
            continue
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            print(json.dumps({"plugin": plugin, "error": done.stderr.strip().splitlines()[-1:]}))
            continue
        print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
