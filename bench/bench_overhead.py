"""Per-call overhead and lowering speed (issue 8, parts of "Done when"), measured in one process.

(a) A trivial graph, `x + 1` on 16 floats: median time per call of eager PyTorch, Inductor and
    tpuc through `torch.compile`; of a backend whose compiled graph returns a ready output (what
    Dynamo's guards and AOTAutograd's runtime wrapper cost every backend); of each backend's own
    compiled callable as AOTAutograd calls it (Inductor's `CompiledFxGraph`, tpuc's
    `CompiledGraph` and its Rust call plan); of tpuc's runtime with host array tuples
    (`Executable.run`: upload, execute, copy out); and of the bare PJRT execute on a resident
    buffer (`bare_execute_seconds`), interleaved in rounds so that load on the machine hits all
    of them alike.
(b) Lowering time on the same AOTAutograd forward graph of zoo models: tpuc (FX export + import +
    cleanup passes + specialize + StableHLO emission; no XLA compile) vs torch-mlir's
    `stateless_fx_import(gm, output_type="stablehlo")`.

    .venv/bin/python bench/bench_overhead.py [--calls 2000] [--models gpt2 bert resnet18]

Writes bench/results/overhead.json and overhead.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _median_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(calls: int, rounds: int) -> dict:
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor import output_code

    from tpuc import _native, backend

    graphs, inductor_graphs = [], []
    original = backend.CompiledGraph.__init__
    original_fx_call = output_code.CompiledFxGraph.__call__

    def recording(self, *a, **k):
        original(self, *a, **k)
        graphs.append(self)

    def recording_call(self, inputs):
        inductor_graphs.append(self)
        return original_fx_call(self, inputs)

    backend.CompiledGraph.__init__ = recording
    output_code.CompiledFxGraph.__call__ = recording_call
    x = torch.randn(16)

    def f(t):
        return t + 1

    def ready_output_backend(gm, example_inputs):
        # Dynamo + AOTAutograd exactly as for tpuc and Inductor; the graph itself costs nothing
        ready = [torch.empty(16)]

        def fw(_g, _ins):
            def run(args):
                return ready

            run._boxed_call = True
            return run

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    tpuc_fn = torch.compile(f, backend="tpu", options={"cache_dir": None})
    inductor_fn = torch.compile(f)
    ready_fn = torch.compile(f, backend=ready_output_backend)
    tpuc_fn(x)
    inductor_fn(x)
    ready_fn(x)
    backend.CompiledGraph.__init__ = original
    output_code.CompiledFxGraph.__call__ = original_fx_call
    graph, inductor_graph = graphs[-1], inductor_graphs[-1]
    exe = graph.static[0]
    out = torch.empty(16)
    host = backend._host_array
    buf = graph.runtime.upload(host(x))
    plan = graph.fast
    variants = {
        "eager": lambda: f(x),
        "inductor (torch.compile)": lambda: inductor_fn(x),
        "tpuc (torch.compile)": lambda: tpuc_fn(x),
        "ready-output backend (torch.compile: Dynamo + AOTAutograd only)": lambda: ready_fn(x),
        "inductor compiled graph (CompiledFxGraph call)": lambda: inductor_graph([x]),
        "tpuc compiled graph (CompiledGraph call)": lambda: graph([x]),
        "tpuc call plan (the Rust hot path)": lambda: plan([x]),
        "tpuc runtime (Executable.run, host tuples)": lambda: exe.run([host(x)], [host(out)]),
    }
    results: dict[str, list[float]] = {k: [] for k in variants}
    results["bare PJRT execute"] = []
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(50):
                fn()
            results[name].append(_median_call(fn, calls))
        results["bare PJRT execute"].append(statistics.median(exe.bare_execute_seconds([buf], calls)))
    assert isinstance(buf, _native.DeviceBuffer)
    return {k: statistics.median(v) for k, v in results.items()}


def lowering(models: list[str]) -> list[dict]:
    import zoo
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch_mlir import fx as mlir_fx

    from tpuc import _native, backend, fx_export, runtime

    rt = runtime.get_runtime(None)
    rows = []
    for name in models:
        model, inputs = zoo.make(name)
        captured = []

        def capture(gm, example_inputs, captured=captured):
            def fw(g, _ins):
                captured.append(g)
                return g.forward

            return aot_module_simplified(
                gm, example_inputs, fw_compiler=fw, decompositions=backend._DECOMPOSITIONS
            )

        from torch.nn.attention import SDPBackend, sdpa_kernel

        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # as the tpu backend traces
            torch.compile(model, backend=capture)(*inputs)
        gm = captured[0]
        t0 = time.perf_counter()
        wire, _ = fx_export.export(gm)
        graph = _native.FxGraph.from_json(wire)
        _, graph = graph.cleanup(None)
        front = time.perf_counter() - t0
        exe = rt.compile(graph, {}, "highest", None, None)
        tpuc_s = front + exe.lower_seconds
        t0 = time.perf_counter()
        mlir_fx.stateless_fx_import(gm)  # import only (torch dialect): its cheapest mode
        mlir_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            mlir_fx.stateless_fx_import(gm, output_type="stablehlo")
            mlir_hlo_s = time.perf_counter() - t0
        except Exception as e:  # the torch-mlir pipeline rejects some graphs
            mlir_hlo_s = f"fails: {type(e).__name__}"
        rows.append(
            {
                "model": name,
                "aten_ops": sum(1 for n in gm.graph.nodes if n.op == "call_function"),
                "tpuc_lower_seconds": tpuc_s,
                "torch_mlir_seconds": mlir_s,
                "torch_mlir_stablehlo_seconds": mlir_hlo_s,
                "xla_compile_seconds": exe.compile_seconds,
            }
        )
        torch._dynamo.reset()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", nargs="*", default=["gpt2", "bert", "resnet18"])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    torch.set_num_threads(1)
    over = overhead(args.calls, args.rounds)
    low = lowering(args.models)
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python bench/bench_overhead.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "torch_threads": 1,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(
        json.dumps({"info": info, "overhead": over, "lowering": low}, indent=2)
    )
    bare = over["bare PJRT execute"]
    lines = [
        "# Per-call overhead and lowering speed",
        "",
        f"{info['date']}, {info['cpus']} CPUs, 1 torch thread. Command: `{info['command']}`.",
        "",
        "`x + 1` on 16 floats, median per call (medians of interleaved rounds):",
        "",
        "| path | us per call | vs bare PJRT execute |",
        "|---|---:|---:|",
    ]
    for k, v in over.items():
        lines.append(f"| {k} | {v * 1e6:.1f} | {v / bare:.2f}x |")
    ready = over["ready-output backend (torch.compile: Dynamo + AOTAutograd only)"]
    lines += [
        "",
        "What each backend adds to a call inside `torch.compile` (its time minus the ready-output "
        "backend's): "
        + ", ".join(
            f"{b} {(over[f'{b} (torch.compile)'] - ready) * 1e6:.1f} us "
            f"({(over[f'{b} (torch.compile)'] - ready) / bare:.2f}x the bare execute)"
            for b in ("tpuc", "inductor")
        )
        + ".",
    ]
    lines += [
        "",
        "Lowering the same AOTAutograd forward graph to StableHLO:",
        "",
        "| model | ATen ops | tpuc lowering ms | torch-mlir import ms | torch-mlir / tpuc "
        "| torch-mlir to StableHLO ms | XLA compile ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in low:
        h = r["torch_mlir_stablehlo_seconds"]
        hlo = f"{h * 1e3:.1f}" if isinstance(h, float) else h
        lines.append(
            f"| {r['model']} | {r['aten_ops']} | {r['tpuc_lower_seconds'] * 1e3:.1f} | "
            f"{r['torch_mlir_seconds'] * 1e3:.1f} | {r['torch_mlir_seconds'] / r['tpuc_lower_seconds']:.1f}x | "
            f"{hlo} | {r['xla_compile_seconds'] * 1e3:.0f} |"
        )
    (args.out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
