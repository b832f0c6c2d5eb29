"""Compiling for TPU slices without a TPU: XLA:TPU compile seconds and memory per chip of the
zoo's reference models (inference and training, meshes), and of a Llama-3-8B-shaped decoder
built on the meta device, fsdp over a v5p slice. Writes bench/results/targets.md (newest first).

    .venv/bin/python bench/bench_targets.py [--skip-8b] [--8b-only] [--8b-train]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

import tpuc  # noqa: E402
from tpuc import targets  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "targets.md"
V5E = "tpu:v5e:2x2"


def _run(label, model, inputs, target=V5E, training=False, **options) -> list[str]:
    torch._dynamo.reset()
    t = time.perf_counter()
    report = tpuc.precompile(
        model,
        inputs,
        options={"target": target, "cache_dir": tempfile.mkdtemp(), **options},
        training=training,
    )
    wall = time.perf_counter() - t
    rows = []
    for g in report["per_graph"]:
        h = g["hbm_bytes"]
        f = targets.fmt_bytes
        rows.append(
            f"| {label} | {target} | {g['name'].split('_')[-1]} | {g['devices']} | {f(h['arguments'])} | "
            f"{f(h['outputs'])} | {f(h['temporaries'])} | {f(h['code'])} | {f(g['footprint_bytes'])} | "
            f"{(g['flops'] or 0) / 1e9:.2f} | {g['compile_seconds']:.1f} |"
        )
    print(f"{label}: {wall:.1f} s", flush=True)
    print("\n".join(rows), flush=True)
    return rows


def _zoo_rows() -> list[str]:
    rows = []
    for name in ["gpt2", "bert", "t5", "resnet18", "vit"]:
        model, inputs = zoo.make(name)
        rows += _run(name, model, inputs)
    for name in ["gpt2", "resnet18"]:
        model, inputs = zoo.make(name)
        model.train()
        if name == "gpt2":
            model, inputs = zoo.LMLoss(model), [inputs[0], inputs[0]]
        rows += _run(f"{name} training", model, inputs, training=True)
    torch.manual_seed(0)
    lm = zoo.LMLoss(zoo.make("gpt2")[0])
    ids = torch.randint(0, zoo.VOCAB, (16, 12))
    for sharding, mesh, target in [
        ("data_parallel", [4, 1], V5E),
        ("fsdp", [4, 1], V5E),
        ("tensor_parallel", [2, 2], V5E),
        ("fsdp", [16, 1], "tpu:v5e:4x4"),
    ]:
        rows += _run(
            f"gpt2 training {sharding}",
            lm,
            [ids, ids],
            target=target,
            training=True,
            mesh={"shape": mesh, "axes": ["data", "model"]},
            sharding=sharding,
        )
    return rows


class _Logits(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, return_dict=False)[0]


def _llama_8b_rows(training: bool) -> list[str]:
    """Inference: batch 4 x 2048 on v5p:2x2x1; training (the backward of the logits' sum: the
    meta device has no autograd kernel for nll_loss): batch 8 x 2048 on v5p:2x2x2."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        lm = transformers.LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in lm.parameters())
    batch, chips, target = (8, 8, "tpu:v5p:2x2x2") if training else (4, 4, "tpu:v5p:2x2x1")
    ids = torch.zeros(batch, 2048, dtype=torch.long, device="meta")
    return _run(
        f"Llama-3-8B shape ({n / 1e9:.2f}B, f32){' training' if training else ''}, {batch}x2048",
        _Logits(lm),
        [ids],
        target=target,
        training=training,
        mesh={"shape": [chips], "axes": ["fsdp"]},
        sharding="fsdp",
    )


class _Checkpointed(torch.nn.Module):
    """A module whose forward runs under non-reentrant activation checkpointing."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _llama_8b_step_rows(layers: int, checkpointed: bool) -> list[str]:
    """One AdamW step (zero_grad, forward, backward of the logits' mean square: the meta device
    has no autograd kernel for nll_loss, AdamW's update) as one executable, `layers` decoder
    layers of the Llama-3-8B shape, batch 8 x 2048, fsdp over v5p:2x2x2; with `checkpointed`,
    each decoder layer under `torch.utils.checkpoint` (non-reentrant)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        lm = transformers.LlamaForCausalLM(cfg)
    lm.train()
    if checkpointed:
        # Each decoder layer under torch.utils.checkpoint directly (transformers'
        # activation_checkpointing_enable is one program too, given use_cache=False).
        lm.model.layers = torch.nn.ModuleList(_Checkpointed(layer) for layer in lm.model.layers)
    opt = torch.optim.AdamW(lm.parameters())

    def step(ids):
        opt.zero_grad(set_to_none=True)
        # No KV cache in a training step: each layer would write it inside its checkpointed
        # region, a side effect Dynamo breaks the graph on (docs/training.md).
        loss = lm(input_ids=ids, use_cache=False, return_dict=False)[0].float().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    n = sum(p.numel() for p in lm.parameters())
    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    label = f"Llama-3-8B shape, {layers} layers ({n / 1e9:.2f}B, f32) AdamW step{', checkpointed' if checkpointed else ''}, 8x2048"
    return _run(
        label,
        step,
        [ids],
        target="tpu:v5p:2x2x2",
        training="step",
        mesh={"shape": [8], "axes": ["fsdp"]},
        sharding="fsdp",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--8b-only", dest="only_8b", action="store_true")
    ap.add_argument(
        "--8b-train", dest="train_8b", action="store_true", help="also the 8B training step (long)"
    )
    ap.add_argument(
        "--8b-step-layers",
        dest="step_layers",
        type=int,
        nargs="*",
        help="only the 8B-shaped AdamW step (one executable) with these layer counts, with and without checkpointing",
    )
    ap.add_argument(
        "--8b-step-kinds", dest="step_kinds", choices=["both", "plain", "checkpointed"], default="both"
    )
    a = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.step_layers:
        kinds = {"both": (False, True), "plain": (False,), "checkpointed": (True,)}[a.step_kinds]
        rows = [r for n in a.step_layers for ck in kinds for r in _llama_8b_step_rows(n, ck)]
        a.skip_8b = True
    else:
        rows = [] if a.only_8b else _zoo_rows()
    if not a.skip_8b:
        rows += _llama_8b_rows(training=False)
        if a.train_8b:
            rows += _llama_8b_rows(training=True)
    head = (
        f"## {time.strftime('%Y-%m-%d %H:%M')} (libtpu, no TPU; bench/bench_targets.py)\n\n"
        "| model | target | graph | chips | arguments | outputs | temporaries | code | per chip | GFLOP | compile s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    old = RESULTS.read_text() if RESULTS.exists() else "# Compiling for TPU targets (newest first)\n\n"
    title, _, rest = old.partition("\n\n")
    RESULTS.write_text(f"{title}\n\n{head}" + "\n".join(rows) + "\n\n" + rest)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
