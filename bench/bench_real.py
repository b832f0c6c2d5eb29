"""Real-size models under eager PyTorch, Inductor and tpuc, side by side in one process.

Cases (random weights, float32, CPU):

* inference: GPT-2 124M (1x128, 8x128 tokens), BERT-base (8x128), ResNet-50 and ViT-B/16 at 224
  (batch 1 and 8), one step of a small diffusion UNet (diffusers' UNet2DConditionModel, 64x64
  latents, when diffusers is installed);
* training steps (forward, backward, SGD step with momentum), the whole step compiled, and for
  tpuc also the model alone compiled (the step split): GPT-2 124M (1x128), ResNet-50 (batch 8);
* generation: a Llama-style ~100M decoder generating 64 tokens greedily with a static KV cache
  (`model.generate(cache_implementation="static")` with `model.forward` compiled): tokens/s, and
  the tokens must be identical to eager's.

Per case, one process: build the model, compile it with each backend, time the first call
(Dynamo + AOTAutograd + the backend's compile + one run; caches are fresh per invocation of
this script), check each backend against eager, then --iters rounds of one timed call per backend,
the order rotated every round so that load on this shared machine hits all alike; median per
backend. tpuc runs on the plugin given by --plugin (a wheel name or a path; default: tpuc's
default), so one invocation per plugin compares plugins against the same Inductor.

    .venv/bin/python bench/bench_real.py [--cases gpt2_1x128 ...] [--iters N] [--plugin NAME]
                                         [--out bench/results] [--tag NAME] [--append]

Writes OUT/real[-TAG].json and OUT/real[-TAG].md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_history  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("eager", "inductor", "tpuc")

# name -> (kind, builder name, builder args). Kinds: infer, train, generate.
CASES = {
    "gpt2_1x128": ("infer", "gpt2", (1, 128)),
    "gpt2_8x128": ("infer", "gpt2", (8, 128)),
    "bert_8x128": ("infer", "bert", (8, 128)),
    "resnet50_b1": ("infer", "resnet50", (1,)),
    "resnet50_b8": ("infer", "resnet50", (8,)),
    "vit_b16_b1": ("infer", "vit_b16", (1,)),
    "vit_b16_b8": ("infer", "vit_b16", (8,)),
    "unet_step": ("infer", "unet", ()),
    "llama100m_gen64": ("generate", "llama100m", ()),
    "gpt2_train_1x128": ("train", "gpt2", (1, 128)),
    "resnet50_train_b8": ("train", "resnet50", (8,)),
}


# ---------------------------------------------------------------- models


def _tokens(torch, batch: int, seq: int, vocab: int):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def build_gpt2(torch, batch, seq):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    ids = _tokens(torch, batch, seq, model.config.vocab_size)
    return model, (ids,), lambda out: out.logits


def build_bert(torch, batch, seq):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig())
    ids = _tokens(torch, batch, seq, model.config.vocab_size)
    return model, (ids,), lambda out: out.last_hidden_state


def _images(torch, batch):
    return (torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)),)


def build_resnet50(torch, batch):
    import torchvision

    return torchvision.models.resnet50(), _images(torch, batch), lambda out: out


def build_vit_b16(torch, batch):
    import torchvision

    model = torchvision.models.vit_b_16()
    # torchvision zero-initializes the classifier, which makes every output 0 and the error
    # column meaningless: random weights, as a trained head has.
    with torch.no_grad():
        model.heads.head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    return model, _images(torch, batch), lambda out: out


def build_unet(torch):
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(64, 128, 256),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=256,
        attention_head_dim=8,
    )
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 64, 64, generator=g)
    text = torch.randn(1, 16, 256, generator=g)
    t = torch.tensor([500])
    return model, (latents, t, text), lambda out: out.sample


def build_llama100m(torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = _tokens(torch, 1, 32, config.vocab_size)
    return model, (ids,), None


def build(torch, name: str):
    kind, builder, args = CASES[name]
    model, inputs, pick = globals()[f"build_{builder}"](torch, *args)
    return kind, model.eval(), inputs, pick


# ---------------------------------------------------------------- one case, one process


def _compile(torch, fn, backend: str, plugin: str | None):
    if backend == "eager":
        return fn
    if backend == "inductor":
        return torch.compile(fn)
    options = {"plugin": plugin} if plugin else {}
    return torch.compile(fn, backend="tpu", options=options)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]


def _max_rel_err(torch, got, want) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


# Untimed interleaved rounds before the timed ones: in one process the backends share the C heap,
# and it takes a round or two of the interleaved order before a backend's large blocks find room
# in it again each call (ResNet-50 training: tpuc's step page-faults 10-80k pages in its first
# interleaved rounds, then none; alone in a process it does not fault after its first call).
WARMUP_ROUNDS = 2


def _interleave(fns: dict, call, iters: int, out: dict) -> dict:
    """Each backend's call times, after WARMUP_ROUNDS untimed rounds in the same order; its page
    faults per timed call go to out[b]["faults_per_call"] (a large graph whose temporaries the
    C heap maps afresh every call spends much of its time in them, and in one process the
    backends change each other's heap)."""
    import resource

    samples = {b: [] for b in fns}
    faults = dict.fromkeys(fns, 0)
    order = list(fns)
    for i in range(WARMUP_ROUNDS):
        k = i % len(order)
        for b in order[k:] + order[:k]:
            call(fns[b])
    for i in range(iters):
        k = i % len(order)
        for b in order[k:] + order[:k]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            call(fns[b])
            samples[b].append(time.perf_counter() - t0)
            faults[b] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    for b in fns:
        out[b]["faults_per_call"] = faults[b] // max(iters, 1)
    return samples


def run_infer(torch, model, inputs, pick, plugin, iters, backends, timed) -> dict:
    out = {b: {} for b in backends}
    fns = {}
    with torch.no_grad():
        expected = pick(model(*inputs))
        for b in backends:
            try:
                fn = _compile(torch, model, b, plugin)
                t0 = time.perf_counter()
                got = pick(fn(*inputs))
                out[b]["first_call_s"] = time.perf_counter() - t0
                out[b]["max_rel_err"] = _max_rel_err(torch, got, expected)
                fn(*inputs)
                fns[b] = fn
            except Exception as e:  # recorded: the row says what failed
                out[b]["error"] = _error(e)
        samples = _interleave(
            {b: f for b, f in fns.items() if b in timed}, lambda fn: fn(*inputs), iters, out
        )
    for b, times in samples.items():
        out[b]["median_ms"] = statistics.median(times) * 1e3
        out[b]["min_ms"] = min(times) * 1e3
    return out


# Training: how the step is compiled. "tpuc" and "inductor" compile the whole step function
# (forward, backward and the optimizer's update: what a user writes; for tpuc one program per
# step, docs/training.md); "tpuc_split" compiles the model only and runs the step around it in
# eager (the forward and backward as separate programs, the update in PyTorch).
SPLIT = "tpuc_split"


def run_train(torch, model, inputs, pick, plugin, iters, backends, timed) -> dict:
    """Forward, loss, backward and an SGD step with momentum, each backend on its own copy of the
    weights (see SPLIT for how each is compiled)."""
    import copy

    model.train()
    if "tpuc" in backends:
        backends = (*backends, SPLIT)
        timed = (*timed, SPLIT) if "tpuc" in timed else timed
    out = {b: {} for b in backends}
    steps = {}

    def make_step(m, b):
        fn = _compile(torch, m, "tpuc", plugin) if b == SPLIT else m
        opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = pick(fn(*inputs)).float().square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step if b in ("eager", SPLIT) else _compile(torch, step, b, plugin)

    losses = {}
    for b in backends:
        m = copy.deepcopy(model)
        try:
            step = make_step(m, b)
            t0 = time.perf_counter()
            losses[b] = step()
            out[b]["first_call_s"] = time.perf_counter() - t0
            step()
            if b.startswith("tpuc"):
                out[b]["programs_per_step"] = _executions(step)
            steps[b] = step
        except Exception as e:
            out[b]["error"] = _error(e)
    for b, loss in losses.items():
        out[b]["max_rel_err"] = abs(loss.item() - losses["eager"].item()) / abs(losses["eager"].item())
    samples = _interleave({b: f for b, f in steps.items() if b in timed}, lambda step: step(), iters, out)
    for b, times in samples.items():
        out[b]["median_ms"] = statistics.median(times) * 1e3
        out[b]["min_ms"] = min(times) * 1e3
    return out


def _executions(step) -> int:
    """tpuc executions in one call of `step`."""
    import tpuc

    before = tpuc.stats()["executions"]
    step()
    return tpuc.stats()["executions"] - before


def run_generate(torch, model, inputs, pick, plugin, iters, backends, timed, new_tokens: int = 64) -> dict:
    (ids,) = inputs
    out = {b: {} for b in backends}
    forward = model.forward
    fns = {}
    tokens = {}

    def generate(fn):
        model.forward = fn
        try:
            return model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )
        finally:
            model.forward = forward

    with torch.no_grad():
        for b in backends:
            try:
                fn = _compile(torch, forward, b, plugin)
                t0 = time.perf_counter()
                tokens[b] = generate(fn)
                out[b]["first_call_s"] = time.perf_counter() - t0
                fns[b] = fn
            except Exception as e:
                out[b]["error"] = _error(e)
        for b, t in tokens.items():
            out[b]["tokens_identical"] = bool(torch.equal(t, tokens["eager"]))
            out[b]["max_rel_err"] = 0.0 if out[b]["tokens_identical"] else 1.0
        samples = _interleave({b: f for b, f in fns.items() if b in timed}, generate, iters, out)
    for b, times in samples.items():
        out[b]["median_ms"] = statistics.median(times) * 1e3
        out[b]["min_ms"] = min(times) * 1e3
        out[b]["tokens_per_s"] = new_tokens / statistics.median(times)
    return out


def child(args) -> dict:
    import torch

    torch.manual_seed(0)
    kind, model, inputs, pick = build(torch, args.child)
    runner = {"infer": run_infer, "train": run_train, "generate": run_generate}[kind]
    # One backend per process: eager still runs once (the reference), only `backend` is timed.
    timed = (args.backend,) if args.backend else BACKENDS
    backends = tuple(dict.fromkeys(("eager", *timed)))
    result = runner(torch, model, inputs, pick, args.plugin, args.iters, backends, timed)
    result["kind"] = kind
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    if "tpuc" in result and "error" not in result["tpuc"]:
        import tpuc

        stats = tpuc.stats()
        result["tpuc"]["fallback_ops"] = sum(stats["fallback_ops"].values())
        result["tpuc"]["graphs"] = stats["graphs_compiled"]
    return result


# ---------------------------------------------------------------- driver


def _run_child(case: str, args, cache: Path, backend: str | None = None) -> dict:
    env = dict(os.environ)
    for k in ("TPUC_LOG", "TPUC_DUMP_DIR"):
        env.pop(k, None)
    env["TPUC_CACHE_DIR"] = str(cache / "tpuc")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    cmd = [sys.executable, __file__, "--child", case, "--iters", str(args.iters)]
    if args.plugin:
        cmd += ["--plugin", args.plugin]
    if backend:
        cmd += ["--backend", backend]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()] or ["failed"]
        return {"error": lines[-1][:300], "wall_s": time.perf_counter() - t0}
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def _run_separately(case: str, args, cache: Path) -> dict:
    """Each backend in a process of its own, --rounds times with the order rotated; per backend
    the median of the rounds' medians. In one process the backends change each other's state:
    after tpuc has run, glibc keeps a larger heap, which spares Inductor's and eager's
    convolutions their page faults (ResNet-50 b1 under Inductor: 44 ms alone, 33 ms next to
    tpuc), and OpenMP's spinning threads share the cores with XLA's."""
    result: dict = {}
    rounds = {b: [] for b in (*BACKENDS, SPLIT)}
    for i in range(args.rounds):
        for b in BACKENDS[i % len(BACKENDS) :] + BACKENDS[: i % len(BACKENDS)]:
            r = _run_child(case, args, cache, backend=b)
            result.setdefault("wall_s", 0.0)
            result["wall_s"] += r.get("wall_s", 0.0)
            if "error" in r and b not in r:
                result.setdefault(b, {"error": r["error"]})
                continue
            result.setdefault("kind", r["kind"])
            result.setdefault("params_m", r["params_m"])
            rounds[b].append(r[b])
            if b == "tpuc" and SPLIT in r:
                rounds[SPLIT].append(r[SPLIT])
    for b, rs in rounds.items():
        timed = [x for x in rs if "median_ms" in x]
        if not rs:
            continue
        entry = dict(rs[0])  # first call and error: the first round's (fresh caches)
        if timed:
            for key in ("median_ms", "tokens_per_s"):
                if key in timed[0]:
                    entry[key] = statistics.median(x[key] for x in timed)
            entry["min_ms"] = min(x["min_ms"] for x in timed)
            entry["faults_per_call"] = statistics.median(x.get("faults_per_call", 0) for x in timed)
            entry["round_medians_ms"] = [x["median_ms"] for x in timed]
        result[b] = entry
    return result


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _ratio(r: dict, a: str, b: str):
    x, y = r.get(a, {}).get("median_ms"), r.get(b, {}).get("median_ms")
    return x / y if x and y else None


def _count(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1000:.0f}k" if n >= 10_000 else f"{n:.0f}"


def markdown(report: dict) -> str:
    info = report["info"]
    lines = [
        f"# Real-size models: eager vs Inductor vs tpuc, {info['date']}",
        "",
        f"torch {info['torch']}, {info['cpus']} CPUs ({info['machine']}), tpuc plugin: {info['plugin']}; "
        f"load average {info['load_start']:.2f} at start, {info['load_end']:.2f} at end; "
        + (
            f"each backend in its own process, {info['rounds']} rounds (order rotated) of "
            f"{info['iters']} calls, median of the rounds' medians"
            if info.get("separate")
            else f"{info['iters']} interleaved rounds per case in one process after {WARMUP_ROUNDS} untimed ones, median"
        )
        + f". Command: `{info['command']}`.",
        "",
        "| case | params | eager ms | Inductor ms | tpuc ms | tpuc/Inductor | tpuc/eager | "
        "first call s (eager / Inductor / tpuc) | page faults per call (eager / Inductor / tpuc) | "
        "tpuc error |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]

    def ms(r, b):
        v = r.get(b, {}).get("median_ms")
        return f"{v:.1f}" if v else r.get(b, {}).get("error", r.get("error", "-"))[:60]

    groups = {"infer": [], "train": [], "generate": []}
    for case, r in report["cases"].items():
        ti, te = _ratio(r, "tpuc", "inductor"), _ratio(r, "tpuc", "eager")
        if ti:
            groups[r.get("kind", "infer")].append(ti)
        first = " / ".join(f"{r.get(b, {}).get('first_call_s', float('nan')):.1f}" for b in BACKENDS)
        faults = " / ".join(_count(r.get(b, {}).get("faults_per_call")) for b in BACKENDS)
        err = r.get("tpuc", {}).get("max_rel_err")
        if r.get("kind") == "generate":
            tps = [r.get(b, {}).get("tokens_per_s") for b in BACKENDS]
            err_text = "tokens identical" if r.get("tpuc", {}).get("tokens_identical") else "tokens differ"
            extra = " (tokens/s: " + " / ".join(f"{x:.1f}" if x else "-" for x in tps) + ")"
        else:
            err_text = f"{err:.1e}" if err is not None else "-"
            extra = ""
        lines.append(
            f"| {case} | {r.get('params_m', 0):.0f}M | {ms(r, 'eager')} | {ms(r, 'inductor')} | "
            f"{ms(r, 'tpuc')}{extra} | {f'{ti:.2f}x' if ti else '-'} | {f'{te:.2f}x' if te else '-'} | "
            f"{first} | {faults} | {err_text} |"
        )
    lines.append("")
    for kind, ratios in groups.items():
        g = _geomean(ratios)
        if g:
            lines.append(f"- geomean tpuc/Inductor, {kind}: **{g:.2f}x** over {len(ratios)} cases")
    train = {c: r for c, r in report["cases"].items() if r.get("kind") == "train"}
    if train:
        lines += [
            "",
            "Training steps (SGD with momentum): tpuc compiling the whole step (one program per step) "
            "against tpuc compiling the model only (the step around it in eager), and Inductor compiling "
            "the whole step:",
            "",
            "| case | tpuc, whole step ms | tpuc, model only ms | Inductor ms | model only / whole | "
            "whole / Inductor | tpuc programs per step (whole / model only) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for case, r in train.items():
            split, whole = _ratio(r, SPLIT, "tpuc"), _ratio(r, "tpuc", "inductor")
            programs = " / ".join(str(r.get(b, {}).get("programs_per_step", "-")) for b in ("tpuc", SPLIT))
            lines.append(
                f"| {case} | {ms(r, 'tpuc')} | {ms(r, SPLIT)} | {ms(r, 'inductor')} | "
                f"{f'{split:.2f}x' if split else '-'} | {f'{whole:.2f}x' if whole else '-'} | {programs} |"
            )
    lines.append(
        "\ntpuc error: largest |tpuc - eager| over the largest |eager| of the output (training: of the"
        " first step's loss)."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--plugin", default=None, help="tpuc's plugin (a wheel name or a path)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default=None, help="suffix of the result files")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the cases already in the result file (run others, or again)",
    )
    ap.add_argument(
        "--separate",
        action="store_true",
        help="each backend in its own process (--rounds, order rotated), not interleaved in one",
    )
    ap.add_argument("--rounds", type=int, default=3, help="with --separate: processes per backend")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    import torch

    report = {
        "info": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "plugin": args.plugin or "default",
            "iters": args.iters,
            "separate": args.separate,
            "rounds": args.rounds if args.separate else None,
            "load_start": os.getloadavg()[0],
            "command": "python bench/bench_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "cases": {},
    }
    name = "real" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.append and (args.out / f"{name}.json").is_file():
        previous = json.loads((args.out / f"{name}.json").read_text())
        report["cases"] = previous["cases"]
        report["info"]["load_start"] = previous["info"]["load_start"]
        # The same run, continued: its results file keeps one entry (results_history.py).
        report["info"]["date"] = previous["info"]["date"]
    with tempfile.TemporaryDirectory(prefix="tpuc-bench-real-") as tmp:
        for case in args.cases:
            r = (_run_separately if args.separate else _run_child)(case, args, Path(tmp))
            report["cases"][case] = r
            ti = _ratio(r, "tpuc", "inductor")
            print(
                f"{case}: "
                + ", ".join(f"{b} {r.get(b, {}).get('median_ms', float('nan')):.1f} ms" for b in BACKENDS)
                + (
                    f", tpuc/Inductor {ti:.2f}x"
                    if ti
                    else f" {r.get('error') or r.get('tpuc', {}).get('error', '')}"
                ),
                flush=True,
            )
            report["info"]["load_end"] = os.getloadavg()[0]
            (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
            results_history.write_markdown(args.out / f"{name}.md", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
