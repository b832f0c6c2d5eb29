"""First-call and steady seconds of transformer stacks with their blocks marked as compile regions
(`@torch.compiler.nested_compile_region`, compiled once by tpuc: python/tpuc/regions.py) or not,
on the CPU plugin (issue 41).

Models (transformers configs, random weights, inference 1x128 tokens):
* gpt2: GPT-2 124M (12 blocks);
* llama16: a Llama-style decoder of 16 layers (hidden 512, GQA 8/4 heads, SwiGLU 1408).

Each variant's first call runs in a fresh process with no executable cache (repeated `--reps`
times, alternating variants; the minimum is kept), split into Dynamo's trace, AOTAutograd's trace,
tpuc's import, passes and lowering, XLA's compile and the first execution. The steady per-call time
of both variants is measured in one process, calls alternating between them, so that both see the
same load.

    .venv/bin/python bench/bench_regions.py [--models gpt2 llama16] [--reps 2] [--calls 30]
        [--out bench/results/regions.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# marked: the blocks marked, the CPU plugin's default (regions inlined into one executable);
# marked-exe: marked, each region an executable of its own (`regions="executables"`, the GPU's
# default, TPU's and targets' before the loop). The XLA:TPU compile's "marked" is one executable
# per region too (a target's default is now the loop: bench/bench_block_loops.py).
VARIANTS = ("unmarked", "marked", "marked-exe")
TPU_VARIANTS = ("unmarked", "marked")


def build(name: str):
    """(model, (ids,), the block class) for `name`."""
    import torch

    torch.manual_seed(0)
    if name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        layers = int(name[4:] or 12)
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, use_cache=False))
        block, vocab = GPT2Block, model.config.vocab_size
    elif name.startswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=int(name[5:] or 16),
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            use_cache=False,
        )
        model = LlamaForCausalLM(config)
        block, vocab = LlamaDecoderLayer, config.vocab_size
    else:
        raise SystemExit(f"unknown model {name}")
    ids = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(0))
    return model.eval(), (ids,), block


def mark_blocks(model, block_cls) -> int:
    """Marks every `block_cls` module of `model` as a compile region (its class swapped for a
    subclass whose forward is decorated: this model only). Returns how many."""
    import torch

    marked = type(
        f"Marked{block_cls.__name__}",
        (block_cls,),
        {"forward": torch.compiler.nested_compile_region(block_cls.forward)},
    )
    n = 0
    for m in model.modules():
        if type(m) is block_cls:
            m.__class__ = marked
            n += 1
    return n


def _compiled(model, block, variant: str):
    import torch

    options = {"cache_dir": None}
    if variant.startswith("marked"):
        mark_blocks(model, block)
    if variant == "marked-exe":
        options["regions"] = "executables"
    return torch.compile(model, backend="tpu", options=options)


def first_call(name: str, variant: str) -> dict:
    """One fresh process's first call, split into phases (seconds)."""
    import torch
    from torch._functorch._aot_autograd import autograd_cache as aot_cache

    import tpuc
    from tpuc import backend, runtime

    model, inputs, block = build(name)
    with torch.no_grad():
        model(*inputs)  # warm PyTorch itself (allocator, kernels) out of the measurement
    # The plugin's start (client, the known-answer check of its math, kept per plugin build in the
    # cache folder, which is empty here) is paid once per process whatever the model: measured
    # apart, out of the first call.
    t0 = time.perf_counter()
    runtime.get_runtime(None)
    plugin_start = time.perf_counter() - t0
    spent = {"backend": 0.0, "tpuc": 0.0, "start": None, "end": None, "key": 0.0}
    depth = [0]
    original_backend, original_compile = backend._compile, backend.compile_graph
    original_key = aot_cache.autograd_cache_key

    def timed_key(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_key(*args, **kwargs)
        finally:
            spent["key"] += time.perf_counter() - t0

    def timed_backend(*args, **kwargs):
        t0 = time.perf_counter()
        spent["start"] = spent["start"] or t0
        try:
            return original_backend(*args, **kwargs)
        finally:
            spent["end"] = time.perf_counter()
            spent["backend"] += spent["end"] - t0

    def timed_compile(*args, **kwargs):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return original_compile(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent["tpuc"] += time.perf_counter() - t0

    backend._compile, backend.compile_graph = timed_backend, timed_compile
    aot_cache.autograd_cache_key = timed_key
    compiled = _compiled(model, block, variant)
    tpuc.reset_stats()
    with torch.no_grad():
        t_first = time.perf_counter()
        compiled(*inputs)
        first = time.perf_counter() - t_first
        steady = []
        for _ in range(5):
            t0 = time.perf_counter()
            compiled(*inputs)
            steady.append(time.perf_counter() - t0)
    s = tpuc.stats()
    run = statistics.median(steady)
    return {
        "first": first,
        # Dynamo's trace before the backend; after it, Dynamo's guards and the first execution
        "dynamo": spent["start"] - t_first,
        "aot": spent["backend"] - spent["tpuc"],
        "aot_key": spent["key"],
        "plugin_start": plugin_start,
        "tpuc": spent["tpuc"] - s["compile_seconds"],
        "xla": s["compile_seconds"],
        "run": t_first + first - spent["end"],
        "steady": run,
        "load": os.getloadavg()[0],
        "xla_compiles": s["xla_compiles"],
        "regions": s["regions_compiled"],
        "fallback_ops": s["fallback_ops"],
    }


def first_call_torch(name: str, variant: str, backend: str) -> dict:
    """A fresh process's first call with one of PyTorch's own backends (`aot_eager`: Dynamo and
    AOTAutograd, then eager kernels; `inductor`), unmarked or marked: how much of the first call
    marking can save in PyTorch's part alone."""
    import torch

    model, inputs, block = build(name)
    with torch.no_grad():
        model(*inputs)
    if variant == "marked":
        mark_blocks(model, block)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*inputs)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled(*inputs)
    return {"first": first, "second": time.perf_counter() - t0, "load": os.getloadavg()[0]}


def steady(name: str, calls: int) -> dict:
    """Median and minimum per-call seconds of the variants, calls alternating (on a loaded host
    the minimum is the steadier figure), and their largest difference from eager."""
    import torch

    model, inputs, block = build(name)
    fns = {}
    for v in VARIANTS:
        copy, _, _ = build(name)
        copy.load_state_dict(model.state_dict())
        fns[v] = _compiled(copy, block, v)
    times = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    with torch.no_grad():
        ref = model(*inputs).logits
        err = {v: float((fns[v](*inputs).logits - ref).abs().max()) for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                fns[v](*inputs)
        for _ in range(calls):
            for v in VARIANTS:
                c0, t0 = time.process_time(), time.perf_counter()
                fns[v](*inputs)
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
    return {
        v: {
            "median": statistics.median(times[v]),
            "min": min(times[v]),
            # CPU seconds of all the process's threads: what other jobs on the host disturb least
            "cpu_median": statistics.median(cpu[v]),
            "max_abs_err": err[v],
        }
        for v in VARIANTS
    }


def tpu_compile(name: str, variant: str, target: str, dump: str | None = None) -> dict:
    """XLA:TPU compile seconds of the model's inference graph(s) for `target` (libtpu's
    compile-only topology, no TPU needed), nothing cached; the modules dumped into `dump`."""
    import torch

    import tpuc

    model, inputs, block = build(name)
    if variant == "marked":
        mark_blocks(model, block)
    t0 = time.perf_counter()
    options = {"target": target, "cache_dir": None, "regions": "executables"}
    options.update({"dump_dir": dump} if dump else {})
    report = tpuc.precompile(model, list(inputs), options=options)
    return {
        "seconds": time.perf_counter() - t0,
        "xla": report["compile_seconds"],
        "executables": report["executables"],
        "per_graph": {g["name"]: round(g["compile_seconds"], 2) for g in report["per_graph"]},
        "regions": tpuc.stats()["regions_compiled"],
        "torch": torch.__version__,
    }


def _child(args) -> None:
    if args.child == "first":
        out = first_call(args.model, args.variant)
    elif args.child == "first-torch":
        out = first_call_torch(args.model, args.variant, args.backend)
    elif args.child == "tpu":
        out = tpu_compile(args.model, args.variant, args.target, args.dump)
    else:
        out = steady(args.model, args.calls)
    print("RESULT " + json.dumps(out))


def _run_child(*argv) -> dict:
    # Cold: empty executable and AOTAutograd caches (which hold tpuc's graphs too).
    env = dict(
        os.environ,
        TPUC_CACHE_DIR=tempfile.mkdtemp(prefix="tpuc-bench-regions-"),
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="tpuc-bench-regions-torch-"),
    )
    proc = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def twin_depth(jax_python: str, target: str, dumps: dict) -> dict:
    """bench/tpu_twins/depth.py's compile seconds at tpuc's precision (PyTorch's default float32
    matmul precision: "highest"), tpuc's dumps among them."""
    topology = target.split(":", 1)[1]
    argv = [jax_python, str(Path(__file__).parent / "tpu_twins" / "depth.py"), "--topology", topology]
    argv += ["--precision", "highest", *(f"--tpuc={v}={d}" for v, d in dumps.items())]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])["seconds"]
    raise SystemExit(f"depth.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _depth_table(results: dict) -> str:
    rows = results.get("gpt2", {}).get("depth")
    if not rows:
        return ""
    lines = [
        "| GPT-2 124M, XLA:TPU compile (one libtpu) | seconds | vs the same network unrolled |",
        "|---|---|---|",
    ]
    for name, s in rows.items():
        base = rows["tpuc unmarked"] if name.startswith("tpuc") else rows["jax unrolled"]
        lines.append(f"| {name} | {s:.2f} | {s / base:.2f}x |")
    return "\n".join(lines)


def _table(results: dict) -> str:
    lines = [
        "| model | variant | first call s | vs unmarked | Dynamo | AOTAutograd | tpuc (import, passes, lower) "
        "| XLA compile | first run | XLA compiles | steady ms (median / min) | steady CPU ms (median) "
        "| XLA:TPU compile s (executables) | vs unmarked | max abs err vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for v in VARIANTS:
            f, s, t = r["first"][v], r["steady"][v], r["tpu"].get(v)
            base, tbase = r["first"]["unmarked"], r["tpu"].get("unmarked")
            tpu = f"{t['xla']:.1f} ({t['executables']})" if t else "-"
            tratio = f"{t['xla'] / tbase['xla']:.2f}x" if t and tbase else "-"
            lines.append(
                f"| {name} | {v} | {f['first']:.2f} | {f['first'] / base['first']:.2f}x | {f['dynamo']:.2f} "
                f"| {f['aot']:.2f} | {f['tpuc']:.2f} | {f['xla']:.2f} | {f['run']:.2f} | {f['xla_compiles']} "
                f"| {s['median'] * 1e3:.1f} / {s['min'] * 1e3:.1f} | {s['cpu_median'] * 1e3:.1f} "
                f"| {tpu} | {tratio} | {s['max_abs_err']:.1e} |"
            )
    return "\n".join(lines)


def _header(args, results: dict, started: str) -> str:
    loads = [f["load"] for r in results.values() for fs in r["firsts"].values() for f in fs]
    plugin = [f["plugin_start"] for r in results.values() for fs in r["firsts"].values() for f in fs]
    return (
        "# Compile regions (issue 41): first call, steady calls and XLA:TPU compile, marked vs unmarked blocks\n\n"
        f"`.venv/bin/python bench/bench_regions.py --models {' '.join(args.models)} --reps {args.reps} "
        f"--calls {args.calls} --target {args.target}`, {started} to {time.strftime('%H:%M UTC', time.gmtime())}, "
        f"CPU plugin, 2-core host shared with other jobs (1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        "at the end of the first-call runs). Inference, 1x128 tokens, random weights, `use_cache=False`; "
        "`options={'cache_dir': None}` (no tpuc cache, hence no AOTAutograd cache either). Variants: unmarked; "
        "marked (the blocks marked `nested_compile_region`, the CPU plugin's default `regions='auto'`: "
        "inlined, one executable); marked-exe (marked, `regions='executables'`: one executable per region, "
        "launched at each call site; what TPU, GPU and targets get by default). First call: a fresh "
        f"process each (best of {args.reps}, variants alternating), after the plugin's start "
        f"({min(plugin):.1f}-{max(plugin):.1f} s here: the client and the known-answer check of its math, "
        "once per process whatever the model). Steady: both variants in one process, calls alternating "
        f"({args.calls} each); CPU ms = process CPU seconds per call (all threads), which the other jobs "
        "disturb less than wall time. XLA:TPU: `tpuc.precompile` for the target in a fresh process, the "
        "sum of its executables' compile seconds.\n\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "llama16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", type=Path)
    p.add_argument("--target", default="tpu:v5e:2x2", help="TPU target of the XLA:TPU compile ('' skips it)")
    p.add_argument("--child", choices=["first", "first-torch", "steady", "tpu"], help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    p.add_argument("--tpu-only", action="store_true", help="only the XLA:TPU compiles (and --jax-python's)")
    p.add_argument(
        "--jax-python",
        help="a Python with jax[tpu] (bench/tpu_twins/compare.py): also compiles GPT-2's JAX twin unrolled, "
        "with jax.lax.scan over its blocks, one block alone and the rest alone, and tpuc's GPT-2 graphs, "
        "with that libtpu (bench/tpu_twins/depth.py)",
    )
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    results = {}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for name in args.models:
        if args.tpu_only:
            results[name] = {"tpu": {}}
        firsts: dict = {v: [] for v in VARIANTS}
        for _ in range(0 if args.tpu_only else args.reps):
            for v in VARIANTS:
                firsts[v].append(_run_child("--child", "first", "--model", name, "--variant", v))
                print(name, v, json.dumps(firsts[v][-1]), flush=True)
        if not args.tpu_only:
            best = {v: min(firsts[v], key=lambda r: r["first"]) for v in VARIANTS}
            results[name] = {
                "first": best,
                "firsts": firsts,
                "steady": _run_child("--child", "steady", "--model", name, "--calls", str(args.calls)),
                "tpu": {},
            }
            print(name, "steady", json.dumps(results[name]["steady"]), flush=True)
        dumps = {v: tempfile.mkdtemp(prefix=f"tpuc-bench-regions-{v}-") for v in TPU_VARIANTS}
        for v in TPU_VARIANTS if args.target else ():
            argv = (
                "--child",
                "tpu",
                "--model",
                name,
                "--variant",
                v,
                "--target",
                args.target,
                "--dump",
                dumps[v],
            )
            tpu = _run_child(*argv)
            results[name]["tpu"][v] = tpu
            print(name, v, "tpu", json.dumps(tpu), flush=True)
        if args.jax_python and args.target and name == "gpt2":
            results[name]["depth"] = twin_depth(args.jax_python, args.target, dumps)
            print(name, "depth", json.dumps(results[name]["depth"]), flush=True)
        if args.out and not args.tpu_only:  # after each model: a run cut short keeps what it measured
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
            args.out.write_text(
                _header(args, results, started) + _table(results) + "\n\n" + _depth_table(results) + "\n"
            )
    if args.tpu_only:
        print(json.dumps({name: r["tpu"] for name, r in results.items()}, indent=1))
    else:
        print(_table(results))
    print(_depth_table(results))


if __name__ == "__main__":
    main()
