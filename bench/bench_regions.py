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

VARIANTS = ("unmarked", "marked")


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

    if variant == "marked":
        mark_blocks(model, block)
    return torch.compile(model, backend="tpu", options={"cache_dir": None})


def first_call(name: str, variant: str) -> dict:
    """One fresh process's first call, split into phases (seconds)."""
    import torch

    import tpuc
    from tpuc import backend

    model, inputs, block = build(name)
    with torch.no_grad():
        model(*inputs)  # warm PyTorch itself (allocator, kernels) out of the measurement
    spent = {"backend": 0.0, "tpuc": 0.0, "start": None, "end": None}
    depth = [0]
    original_backend, original_compile = backend._compile, backend.compile_graph

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
        "tpuc": spent["tpuc"] - s["compile_seconds"],
        "xla": s["compile_seconds"],
        "run": t_first + first - spent["end"],
        "steady": run,
        "xla_compiles": s["xla_compiles"],
        "regions": s["regions_compiled"],
        "fallback_ops": s["fallback_ops"],
    }


def steady(name: str, calls: int) -> dict:
    """Median and minimum per-call seconds of both variants, calls alternating (on a loaded host
    the minimum is the steadier figure), and their largest difference from eager."""
    import torch

    model, inputs, block = build(name)
    marked, _, _ = build(name)
    marked.load_state_dict(model.state_dict())
    fns = {"unmarked": _compiled(model, block, "unmarked"), "marked": _compiled(marked, block, "marked")}
    times = {v: [] for v in VARIANTS}
    with torch.no_grad():
        ref = model(*inputs).logits
        err = {v: float((fns[v](*inputs).logits - ref).abs().max()) for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                fns[v](*inputs)
        for _ in range(calls):
            for v in VARIANTS:
                t0 = time.perf_counter()
                fns[v](*inputs)
                times[v].append(time.perf_counter() - t0)
    return {
        v: {"median": statistics.median(times[v]), "min": min(times[v]), "max_abs_err": err[v]}
        for v in VARIANTS
    }


def _child(args) -> None:
    if args.child == "first":
        out = first_call(args.model, args.variant)
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


def _table(results: dict) -> str:
    lines = [
        "| model | variant | first call s | Dynamo | AOTAutograd | tpuc (import, passes, lower) "
        "| XLA compile | first run | XLA compiles | steady ms (median / min) | max abs err vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for v in VARIANTS:
            f, s = r["first"][v], r["steady"][v]
            lines.append(
                f"| {name} | {v} | {f['first']:.2f} | {f['dynamo']:.2f} | {f['aot']:.2f} | {f['tpuc']:.2f} "
                f"| {f['xla']:.2f} | {f['run']:.2f} | {f['xla_compiles']} "
                f"| {s['median'] * 1e3:.1f} / {s['min'] * 1e3:.1f} "
                f"| {s['max_abs_err']:.1e} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "llama16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=["first", "steady"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    results = {}
    for name in args.models:
        firsts: dict = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for v in VARIANTS:
                firsts[v].append(_run_child("--child", "first", "--model", name, "--variant", v))
                print(name, v, json.dumps(firsts[v][-1]), flush=True)
        best = {v: min(firsts[v], key=lambda r: r["first"]) for v in VARIANTS}
        results[name] = {
            "first": best,
            "steady": _run_child("--child", "steady", "--model", name, "--calls", str(args.calls)),
        }
        print(name, "steady", json.dumps(results[name]["steady"]), flush=True)
    table = _table(results)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
