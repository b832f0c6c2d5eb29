"""XLA:TPU's view of tpuc's graphs against the same networks written in JAX, with no TPU.

For each case, tpuc compiles the model for a TPU v5e slice (`tpuc.precompile` with
`options={"target": "tpu:v5e:2x2", "dump_dir": ...}`), which writes every graph's
`stablehlo.mlir`; then `bench/tpu_twins/compare.py`, in its own Python with `jax[tpu]`, compiles
those modules and the JAX twin of the network for the same topology through libtpu's
compile-only client and reports compile seconds and XLA's cost analysis (flops, bytes accessed,
transcendentals) for both. JAX is a measuring tool here, never a dependency of tpuc:

    python3 -m venv ../jaxtpu && ../jaxtpu/bin/pip install "jax[tpu]==0.10.2"
    .venv/bin/python bench/bench_tpu_twins.py [--jax-python ../jaxtpu/bin/python]
        [--cases gpt2 resnet18_infer resnet18_train] [--tag NAME] [--before results/X.json]

Cases (the twins' shapes): GPT-2 124M forward at 1x128 (eval, no cache); ResNet-18 (10 classes)
at 2x3x64x64, inference (eval) and one training step (train mode: the forward and backward
graphs against the twin's gradient of the summed logits). Writes `results/tpu-twins[-TAG].json`
and `.md`; with `--before` the table also shows that run's ratios. Compile seconds move with
the machine's load (+-30% on a shared 2-core host): compare ratios from one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Compile-only: several processes may load libtpu at once (other sessions' tests, compare.py
# beside this one), which its lockfile would refuse.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

HERE = Path(__file__).resolve().parent
TWINS = HERE / "tpu_twins"
TARGET = "tpu:v5e:2x2"

#: case -> (twin, compare.py flags, title)
CASES = {
    "gpt2": ("gpt2", [], "GPT-2 124M forward, 1x128"),
    "resnet18_infer": ("resnet18", [], "ResNet-18 inference, 2x3x64x64"),
    "resnet18_train": ("resnet18", ["--train", "--split"], "ResNet-18 training (forward + backward graphs)"),
    "resnet18_step": ("resnet18", ["--step"], "ResNet-18 whole SGD step (momentum 0.9), one program"),
    "gpt2_step": ("gpt2", ["--step"], "GPT-2 124M whole AdamW step, 1x128, one program"),
}
STEP_CASES = ("resnet18_step", "gpt2_step")


class Logits(torch.nn.Module):
    """GPT-2's logits only (the twin returns nothing else), no key/value cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def build(case: str):
    """(model, inputs, training) of a case, float32, seeded."""
    torch.manual_seed(0)
    if case == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = Logits(GPT2LMHeadModel(GPT2Config()).eval())
        ids = torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(0))
        return model, (ids,), False
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    if case == "resnet18_infer":
        return model.eval(), (x,), False
    return model.train(), (x,), True


def step_case(case: str, layers: int):
    """(step, inputs) of a whole-step case: the twin's optimizer (ResNet-18: SGD lr 0.1, momentum
    0.9, loss the summed logits; GPT-2 without dropout: AdamW's defaults, loss the logits' mean
    square) after one eager step, so that its state exists and is an input, as the twin's is."""
    torch.manual_seed(0)
    if case == "gpt2_step":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config).train()
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(0))

        def loss_of(ids):
            return model(ids, use_cache=False).logits.square().mean()

        inputs = (ids,)
    else:
        import torchvision

        model = torchvision.models.resnet18(num_classes=10).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        inputs = (torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)),)

        def loss_of(x):
            return model(x).sum()

    def step(*args):
        # Gradients cleared at the end: nothing reads them after the step, so the program returns
        # none, as the twin's (docs/training.md).
        loss = loss_of(*args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step(*inputs)
    return step, inputs


def dump(case: str, folder: Path, precision: str, layers: int = 12) -> None:
    """Compiles the case for the target through tpuc, dumping its modules into `folder`."""
    import tpuc

    if case in STEP_CASES:
        from tpuc import targets

        step, inputs = step_case(case, layers)
        with tempfile.TemporaryDirectory() as cache:
            options = {"target": TARGET, "cache_dir": cache, "dump_dir": str(folder), "precision": precision}
            torch._dynamo.reset()
            try:
                torch.compile(step, backend="tpu", options=options)(*inputs)
            except targets.TargetUnavailableError:
                pass  # compiled and stored; this machine has no TPU to run it
        return
    model, inputs, training = build(case)
    with tempfile.TemporaryDirectory() as cache:
        tpuc.precompile(
            model,
            inputs,
            options={"target": TARGET, "cache_dir": cache, "dump_dir": str(folder), "precision": precision},
            training=training,
        )


def tpuc_report(folder: Path) -> dict:
    """tpuc's own target compile of a dump (the project's libtpu), from its graphs' meta.json."""
    metas = [json.loads(p.read_text()) for p in folder.rglob("meta.json")]
    return {
        "graphs": len(metas),
        "compile_seconds": sum(m["timings"]["compile_seconds"] for m in metas),
        "lower_seconds": sum(m["timings"]["lower_seconds"] for m in metas),
        "flops": sum((m.get("cost") or {}).get("flops", 0.0) for m in metas),
        "bytes accessed": sum((m.get("cost") or {}).get("bytes accessed", 0.0) for m in metas),
        "footprint_bytes": max((m.get("footprint_bytes") or 0 for m in metas), default=0),
    }


def op_counts(folder: Path) -> dict:
    """Counts of the StableHLO ops the issue tracks, over every module of a dump."""
    names = [
        "convolution",
        "dot_general",
        "transpose",
        "slice",
        "concatenate",
        "optimization_barrier",
        "composite",
        "exponential",
        "tanh",
        "custom_call",
    ]
    counts = dict.fromkeys(names, 0)
    for path in folder.rglob("stablehlo.mlir"):
        text = path.read_text()
        for n in names:
            counts[n] += text.count(f'"stablehlo.{n}"')
    return counts


def compare(
    jax_python: str, case: str, folder: Path, topology: str, precision: str | None, layers: int = 12
) -> dict:
    """Runs compare.py on a dump; its RESULT line as a dict."""
    twin, flags, _ = CASES[case]
    if case == "gpt2_step":
        flags = [*flags, "--layers", str(layers)]
    cmd = [
        jax_python,
        str(TWINS / "compare.py"),
        "--twin",
        twin,
        "--dump",
        str(folder),
        "--topology",
        topology,
    ]
    if precision:
        flags = [*flags, "--precision", precision]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(cmd + flags, capture_output=True, text=True, env=env, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"compare.py failed for {case} (rc {out.returncode}):\n{out.stdout}\n{out.stderr[-4000:]}"
    )


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def cell(row: dict, was: dict | None, key: str, scale: float, unit: str, digits: int) -> str:
    """`tpuc / JAX unit (ratio; before ratio)` of one measure."""
    t, j = row["tpuc"], row["jax"]
    before = f"; before {ratio(was['tpuc'][key], was['jax'][key]):.2f}x" if was else ""
    return f"{t[key] / scale:.{digits}f} / {j[key] / scale:.{digits}f}{unit} ({ratio(t[key], j[key]):.2f}x{before})"


def table(rows: dict, before: dict | None) -> list[str]:
    lines = [
        "| graph | compile s tpuc / JAX | bytes accessed tpuc / JAX | flops tpuc / JAX | transcendentals tpuc / JAX |",
        "|---|---|---|---|---|",
    ]
    for case, r in rows.items():
        was = (before or {}).get(case)
        lines.append(
            f"| {CASES[case][2]} | {cell(r, was, 'seconds', 1, '', 1)} "
            f"| {cell(r, was, 'bytes accessed', 1e6, ' MB', 0)} | {cell(r, was, 'flops', 1e9, ' GF', 2)} "
            f"| {cell(r, was, 'transcendentals', 1e6, ' M', 2)} |"
        )
    return lines


def split_lines(rows: dict) -> list[str]:
    """The training twin as two programs, as tpuc's step is (compare.py --split): what the split
    into forward and backward executables costs XLA:TPU by itself."""
    lines = []
    for case, r in rows.items():
        s = r.get("jax_split")
        if not s:
            continue
        j, t = r["jax"]["bytes accessed"], r["tpuc"]["bytes accessed"]
        if not lines:
            lines = [
                "The training twin split into two programs as tpuc's step is (`compare.py --split`: a forward "
                "returning `jax.vjp`'s residuals, the inputs among them left out, and a backward from them):",
                "",
                "| graph | bytes accessed: twin, one program | twin, two programs | tpuc, two graphs | tpuc / twin two programs |",
                "|---|---|---|---|---|",
            ]
        lines.append(
            f"| {CASES[case][2]} | {j / 1e6:.0f} MB | {s['bytes accessed'] / 1e6:.0f} MB ({ratio(s['bytes accessed'], j):.2f}x) "
            f"| {t / 1e6:.0f} MB ({ratio(t, j):.2f}x) | {ratio(t, s['bytes accessed']):.2f}x |"
        )
    return [*lines, ""] if lines else []


def memory_lines(rows: dict) -> list[str]:
    """Memory per chip of the whole-step cases (compare.py --step), the twin's state donated."""
    steps = {c: r for c, r in rows.items() if "written_state" in r["tpuc"]}
    if not steps:
        return []
    lines = [
        "Memory per chip of the whole steps (XLA:TPU's memory stats; memory = arguments + outputs "
        "- aliased + temporaries + code):",
        "",
        "| graph | arguments tpuc / JAX | outputs | aliased | temporaries | code | memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, r in steps.items():
        t, j = r["tpuc"], r["jax"]

        def mb(k, t=t, j=j):
            return f"{t[k] / 1e6:.0f} / {j[k] / 1e6:.0f} MB" + (
                f" ({ratio(t[k], j[k]):.2f}x)" if j[k] else ""
            )

        lines.append(
            f"| {CASES[case][2]} | {mb('arguments')} | {mb('outputs')} | {mb('aliased')} | {mb('temporaries')} "
            f"| {mb('code')} | {mb('memory')} |"
        )
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jax-python", default="../jaxtpu/bin/python")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--precision",
        default="highest",
        choices=["highest", "high", "default"],
        help="tpuc's f32 matmul/convolution precision (PyTorch's default: highest)",
    )
    ap.add_argument(
        "--twin-precision",
        default=None,
        help="the twin's (jax.default_matmul_precision); default: JAX's own (one bf16 pass on a TPU)",
    )
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks of the gpt2_step case")
    ap.add_argument("--before", help="an earlier run's JSON, whose ratios the table shows beside")
    ap.add_argument("--dumps", help="keep the dumps in this folder (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="compare the dumps already in --dumps")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--render", nargs="+", help="only write the table of these runs' JSON (cases merged, in order)"
    )
    a = ap.parse_args()
    if a.render:
        runs = [json.loads(Path(p).read_text()) for p in a.render]
        data = {"meta": runs[-1]["meta"], "cases": {}, "tpuc_target": {}, "stablehlo_ops": {}}
        for run in runs:
            for k in ("cases", "tpuc_target", "stablehlo_ops"):
                data[k].update(run[k])
        data["meta"] = {**data["meta"], "merged": [{"cases": list(r["cases"]), **r["meta"]} for r in runs]}
        before = json.loads(Path(a.before).read_text())["cases"] if a.before else None
        write(Path(a.out), "tpu-twins" + (f"-{a.tag}" if a.tag else ""), data, before)
        return

    before = None
    if a.before:
        before = json.loads(Path(a.before).read_text())["cases"]
    keep = Path(a.dumps) if a.dumps else None
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        rows, tpuc_own, ops = {}, {}, {}
        for case in a.cases:
            folder = root / case
            if not (a.reuse and any(folder.rglob("stablehlo.mlir"))):
                if folder.exists():
                    raise SystemExit(f"{folder} exists: give --dumps an empty folder, or --reuse")
                dump(case, folder, a.precision, a.layers)
            tpuc_own[case] = tpuc_report(folder)
            ops[case] = op_counts(folder)
            rows[case] = compare(a.jax_python, case, folder, a.topology, a.twin_precision, a.layers)
            r = rows[case]
            print(
                f"{case}: compile {r['tpuc']['seconds']:.1f} / {r['jax']['seconds']:.1f} s, "
                f"bytes {r['tpuc']['bytes accessed'] / 1e6:.0f} / {r['jax']['bytes accessed'] / 1e6:.0f} MB, "
                f"flops {ratio(r['tpuc']['flops'], r['jax']['flops']):.3f}x, ops {ops[case]}",
                flush=True,
            )

    import tpuc

    git = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    meta = {
        "date": when,
        "git": git,
        "topology": a.topology,
        "target": TARGET,
        "precision": {"tpuc": a.precision, "jax": a.twin_precision or "its default (one bf16 pass)"},
        "load": os.getloadavg(),
        "cpus": os.cpu_count(),
        "tpuc": tpuc.__file__,
    }
    data = {"meta": meta, "cases": rows, "tpuc_target": tpuc_own, "stablehlo_ops": ops}
    write(Path(a.out), "tpu-twins" + (f"-{a.tag}" if a.tag else ""), data, before)


def write(out: Path, stem: str, data: dict, before: dict | None) -> None:
    """`out/stem.json` and the table `out/stem.md`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    meta, rows, ops, tpuc_own = data["meta"], data["cases"], data["stablehlo_ops"], data["tpuc_target"]
    when, git, prec = meta["date"], meta["git"], meta["precision"]
    md = [
        "# tpuc's graphs vs their JAX twins on XLA:TPU (v5e, compile-only)",
        "",
        f"{when}, tpuc {git}, topology {meta['topology']}, load average {meta['load'][0]:.1f} on {meta['cpus']} CPUs; "
        f"f32 matmul precision: tpuc {prec['tpuc']}, JAX {prec['jax']}. "
        "`bench/bench_tpu_twins.py` (dumps through `tpuc.precompile(..., options={'target': "
        f"'{TARGET}', 'dump_dir': ...}})`; whole steps: `torch.compile(step, backend='tpu', options=...)` "
        "after one eager step), then `bench/tpu_twins/compare.py` compiles the dumps and the "
        "twin with the jax[tpu] environment's libtpu). Goal (issue 43): bytes accessed and flops at most "
        "1.05x the twin's, compile seconds at most 1.5x.",
        "",
        *table(rows, before),
        "",
        *(
            [
                "Rows from: "
                + "; ".join(
                    f"{', '.join(m['cases'])}: {m['date']}, tpuc {m['git']}, load {m['load'][0]:.1f}"
                    for m in meta["merged"]
                )
                + " (a case's latest run wins).",
                "",
            ]
            if meta.get("merged")
            else []
        ),
        "StableHLO ops in tpuc's modules (all graphs of a case):",
        "",
        "| graph | " + " | ".join(next(iter(ops.values()))) + " |",
        "|---|" + "---|" * len(next(iter(ops.values()))),
        *(f"| {case} | " + " | ".join(str(v) for v in c.values()) + " |" for case, c in ops.items()),
        "",
        *split_lines(rows),
        *memory_lines(rows),
        "tpuc's own target compile (the project's libtpu, `precompile`'s `per_graph` report):",
        "",
        "| graph | graphs | lower s | compile s | flops | bytes accessed | largest footprint per chip |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {case} | {o['graphs']} | {o['lower_seconds']:.2f} | {o['compile_seconds']:.1f} "
            f"| {o['flops'] / 1e9:.2f} G | {o['bytes accessed'] / 1e6:.0f} MB | {o['footprint_bytes'] / 1e6:.0f} MB |"
            for case, o in tpuc_own.items()
        ),
        "",
    ]
    (out / f"{stem}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
