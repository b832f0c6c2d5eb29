"""Per-call overhead and lowering speed (issue 8, parts of "Done when"), measured in one process.

(a) A trivial graph, `x + 1` on 16 floats: median time per call of eager PyTorch, Inductor and
    tpuc through `torch.compile`; of backends whose compiled graph returns a ready output, through
    AOTAutograd (what Dynamo's guards and AOTAutograd's runtime wrapper cost Inductor) and
    without it (Dynamo alone: what tpuc's plain inference graphs pay, which skip the wrapper);
    of each backend's own compiled callable (Inductor's `CompiledFxGraph`, tpuc's
    `CompiledGraph` and its Rust call plan); of tpuc's runtime with host array tuples
    (`Executable.run`: upload, execute, copy out); and of the bare PJRT execute on a resident
    buffer (`bare_execute_seconds`), interleaved in rounds so that load on the machine hits all
    of them alike.
(b) Lowering time on the same AOTAutograd forward graph of zoo models: tpuc (FX export + import +
    cleanup passes + specialize + StableHLO emission; no XLA compile) vs torch-mlir's
    `stateless_fx_import(gm)` (import to the torch dialect); the first run of each, then the
    medians of `--repeats` runs of each, alternating and in blocks of `--block` (see
    `lowering`). torch-mlir's path to StableHLO (`output_type="stablehlo"`) is timed once.

    .venv/bin/python bench/bench_overhead.py [--calls 2000] [--models gpt2 bert resnet18]
        [--repeats 15] [--block 5]

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

import results_history  # bench/, beside this script
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

    from tpuc import _native, compiled_graph, dtypes

    graphs, inductor_graphs = [], []
    original = compiled_graph.CompiledGraph.__init__
    original_fx_call = output_code.CompiledFxGraph.__call__

    def recording(self, *a, **k):
        original(self, *a, **k)
        graphs.append(self)

    def recording_call(self, inputs):
        inductor_graphs.append(self)
        return original_fx_call(self, inputs)

    compiled_graph.CompiledGraph.__init__ = recording
    output_code.CompiledFxGraph.__call__ = recording_call
    x = torch.randn(16)

    def f(t):
        return t + 1

    def ready_output_backend(gm, example_inputs):
        # Dynamo + AOTAutograd exactly as for Inductor; the graph itself costs nothing
        ready = [torch.empty(16)]

        def fw(_g, _ins):
            def run(args):
                return ready

            run._boxed_call = True
            return run

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    def dynamo_only_backend(gm, example_inputs):
        # Dynamo alone: what tpuc's plain inference graphs pay around the graph (no AOTAutograd
        # runtime wrapper)
        ready = (torch.empty(16),)

        def run(*args):
            return ready

        return run

    tpuc_fn = torch.compile(f, backend="tpu", options={"cache_dir": None})
    inductor_fn = torch.compile(f)
    ready_fn = torch.compile(f, backend=ready_output_backend)
    dynamo_fn = torch.compile(f, backend=dynamo_only_backend)
    tpuc_fn(x)
    inductor_fn(x)
    ready_fn(x)
    dynamo_fn(x)
    compiled_graph.CompiledGraph.__init__ = original
    output_code.CompiledFxGraph.__call__ = original_fx_call
    graph, inductor_graph = graphs[-1], inductor_graphs[-1]
    exe = graph.static[0]
    out = torch.empty(16)
    host = dtypes._host_array
    buf = graph.runtime.upload(host(x))
    plan = graph.fast
    variants = {
        "eager": lambda: f(x),
        "inductor (torch.compile)": lambda: inductor_fn(x),
        "tpuc (torch.compile)": lambda: tpuc_fn(x),
        "ready-output backend (torch.compile: Dynamo + AOTAutograd only)": lambda: ready_fn(x),
        "ready-output backend without AOTAutograd (torch.compile: Dynamo only)": lambda: dynamo_fn(x),
        "inductor compiled graph (CompiledFxGraph call)": lambda: inductor_graph([x]),
        "tpuc compiled graph (CompiledGraph call: Python, then the plan)": lambda: graph([x]),
        "tpuc call plan (the Rust hot path; what Dynamo or AOTAutograd calls)": lambda: plan([x]),
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


def lowering(models: list[str], repeats: int, block: int) -> list[dict]:
    """Per model, from one captured `gm`: the first run of each side, then medians of
    `repeats` more runs of each in two orders, both spreading load on the machine over the two
    alike:
    - alternating: tpuc, torch-mlir, tpuc, ... Each run starts in the caches the other tool's
      run just filled; torch-mlir's 20-30 ms import evicts all of tpuc's working set, tpuc's few
      ms little of torch-mlir's, so this order costs tpuc more (about 1 ms per run here).
    - in blocks: `block` runs of tpuc, then `block` of torch-mlir, repeated: each tool back to
      back in its own warm caches, as when lowering many graphs (the first run of each block is
      after the other tool's).

    tpuc, each run: `fx_export.export_cleaned` (the FX walk, import and cleanup passes, as the
    backend runs them; wall clock), plus
    `exe.lower_seconds` (specialize + StableHLO emission + writing the module as MLIR bytecode,
    timed in Rust).
    Only the first run compiles with XLA; later runs hit the in-memory executable cache *after*
    lowering (the cache key hashes the module's bytecode), so every run redoes all of the lowering.
    torch-mlir, each run: `stateless_fx_import(gm)` (import to its torch dialect, a fresh MLIR
    context each call). Its StableHLO path is timed once (first run)."""
    import zoo
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch_mlir import fx as mlir_fx

    from tpuc import decompositions, fx_export, runtime

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
                gm, example_inputs, fw_compiler=fw, decompositions=decompositions._DECOMPOSITIONS
            )

        from torch.nn.attention import SDPBackend, sdpa_kernel

        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # as the tpu backend traces
            torch.compile(model, backend=capture)(*inputs)
        gm = captured[0]

        def tpuc_once(gm=gm):
            t0 = time.perf_counter()
            graph = fx_export.export_cleaned(gm)[2]  # as the backend imports and cleans up
            front = time.perf_counter() - t0
            exe = rt.compile(graph, {}, "highest", None, None)
            return front + exe.lower_seconds, exe

        def mlir_once(gm=gm):
            t0 = time.perf_counter()
            mlir_fx.stateless_fx_import(gm)  # import only (torch dialect): its cheapest mode
            return time.perf_counter() - t0

        tpuc_first, exe = tpuc_once()
        assert exe.cache == "miss", exe.cache  # the first run compiled: nothing cached before
        mlir_first = mlir_once()

        def tpuc_again(key=exe.key) -> float:
            s, again = tpuc_once()
            assert again.cache == "memory" and again.key == key
            return s

        tpuc_runs, mlir_runs = [], []
        for _ in range(repeats):
            tpuc_runs.append(tpuc_again())
            mlir_runs.append(mlir_once())
        tpuc_blocks, mlir_blocks = [], []
        for _ in range(max(1, repeats // block)):
            tpuc_blocks += [tpuc_again() for _ in range(block)]
            mlir_blocks += [mlir_once() for _ in range(block)]
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
                "repeats": repeats,
                "tpuc_lower_seconds": statistics.median(tpuc_runs),
                "torch_mlir_seconds": statistics.median(mlir_runs),
                "tpuc_lower_first_seconds": tpuc_first,
                "torch_mlir_first_seconds": mlir_first,
                "tpuc_lower_runs": tpuc_runs,
                "torch_mlir_runs": mlir_runs,
                "block": block,
                "tpuc_lower_blocks_seconds": statistics.median(tpuc_blocks),
                "torch_mlir_blocks_seconds": statistics.median(mlir_blocks),
                "tpuc_lower_block_runs": tpuc_blocks,
                "torch_mlir_block_runs": mlir_blocks,
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
    p.add_argument("--repeats", type=int, default=15, help="lowering runs per model after the first")
    p.add_argument("--block", type=int, default=5, help="runs per block in the blocks order")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    torch.set_num_threads(1)
    over = overhead(args.calls, args.rounds)
    low = lowering(args.models, args.repeats, args.block)
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
    dynamo = over["ready-output backend without AOTAutograd (torch.compile: Dynamo only)"]
    # Inductor runs under AOTAutograd's wrapper; tpuc's plain inference graphs skip it.
    floors = {"tpuc": ("Dynamo only", dynamo), "inductor": ("Dynamo + AOTAutograd", ready)}
    lines += [
        "",
        "What each backend adds to a call inside `torch.compile`, over the ready-output backend "
        "with the same wrapping: "
        + ", ".join(
            f"{b} {(over[f'{b} (torch.compile)'] - floor) * 1e6:.1f} us over {what} "
            f"({(over[f'{b} (torch.compile)'] - floor) / bare:.2f}x the bare execute)"
            for b, (what, floor) in floors.items()
        )
        + ".",
    ]
    lines += [
        "",
        "Lowering the same AOTAutograd forward graph, one `gm` per model. tpuc: FX export + import + "
        "cleanup passes + specialize + StableHLO emission and bytecode (no XLA compile); torch-mlir: "
        "`stateless_fx_import(gm)`, import to its torch dialect only. Medians of "
        f"{args.repeats} runs of each after the first, alternating (each run right after the other "
        f"tool's, in the caches it filled) and in blocks ({args.block} runs of one, then of the "
        "other: each back to back in its own caches); first runs alongside:",
        "",
        "| model | ATen ops | tpuc ms (alternating) | torch-mlir ms (alternating) | ratio "
        "| tpuc ms (blocks) | torch-mlir ms (blocks) | ratio "
        "| tpuc ms (first) | torch-mlir ms (first) | ratio "
        "| torch-mlir to StableHLO ms (first) | XLA compile ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in low:
        h = r["torch_mlir_stablehlo_seconds"]
        hlo = f"{h * 1e3:.1f}" if isinstance(h, float) else h
        cells = []
        for t, m in (
            (r["tpuc_lower_seconds"], r["torch_mlir_seconds"]),
            (r["tpuc_lower_blocks_seconds"], r["torch_mlir_blocks_seconds"]),
            (r["tpuc_lower_first_seconds"], r["torch_mlir_first_seconds"]),
        ):
            cells.append(f"{t * 1e3:.2f} | {m * 1e3:.1f} | {m / t:.1f}x")
        lines.append(
            f"| {r['model']} | {r['aten_ops']} | {' | '.join(cells)} | {hlo} "
            f"| {r['xla_compile_seconds'] * 1e3:.0f} |"
        )
    results_history.write_markdown(args.out / "overhead.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
