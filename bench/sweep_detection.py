"""torchvision's 12 detection builders through `torch.compile`, against eager (issue 40).

Each model is built with `weights=None, weights_backbone=None, num_classes=11` and
`min_size=max_size=224` (the fixed-size ones at their own size: 320 for the 320/SSDlite models,
300 for SSD300), seeded, in eval mode, and called once on two images of different sizes
(3x200x240 and 3x180x160). Configurations:

- `random`: torchvision's own initialization (a detector whose scores are near-ties: every
  detection of Faster R-CNN scores 0.0938710942864418);
- `normal`: every parameter drawn from N(0, 0.05);
- `random64`: `random` in float64 (model and images), tpu only: where float32's near-tied scores
  are resolved by real differences, so the comparison checks tpuc's post-processing itself;

each with the model's score threshold at its default and at 0 (`roi_heads.score_thresh` for the
R-CNNs, `score_thresh` for RetinaNet, FCOS and SSD). Per configuration the eager result is the
reference, and every output tensor of `tpu`, `aot_eager` and `inductor` is compared with it
(rtol 1e-4, atol 1e-4 x the tensor's largest magnitude; shapes must match). Recorded per run:
the status (`match`, `differs` with the first differing output and its largest error, or
`error` with the exception), the first call's seconds (tracing and compiling included, caches
off: tpuc's cache_dir=None, Inductor's FX and kernel caches disabled), Dynamo's graph count,
and for tpu the ops run in PyTorch (`fallback_ops`) and `eager_reruns`.

Each model, configuration and backend is its own process (spawned by this script) limited to
--timeout seconds. They go in priority order (tpu on `random`/default and `normal`/0, tpu in
float64, Inductor, aot_eager, then the other configurations) and stop at
--budget seconds; runs not reached are listed as such. Results: bench/results/detection.json and
detection.md (rewritten after every run).

    .venv/bin/python bench/sweep_detection.py [--models NAME ...] [--configs normal/0 ...]
        [--backends aot_eager inductor] [--timeout 900] [--budget 5400]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = [
    "fasterrcnn_mobilenet_v3_large_320_fpn",
    "fasterrcnn_mobilenet_v3_large_fpn",
    "fasterrcnn_resnet50_fpn",
    "fasterrcnn_resnet50_fpn_v2",
    "maskrcnn_resnet50_fpn",
    "maskrcnn_resnet50_fpn_v2",
    "keypointrcnn_resnet50_fpn",
    "retinanet_resnet50_fpn",
    "retinanet_resnet50_fpn_v2",
    "fcos_resnet50_fpn",
    "ssd300_vgg16",
    "ssdlite320_mobilenet_v3_large",
]
CONFIGS = [
    ("random", "default"),
    ("normal", "0"),
    ("random", "0"),
    ("normal", "default"),
    ("random64", "default"),
]
BACKENDS = ["tpu", "aot_eager", "inductor"]
RTOL = 1e-4
ATOL_SCALE = 1e-4
RESULTS = Path(__file__).parent / "results"


def _build(name: str, weights: str, thresh: str):
    import torch
    import torchvision

    torch.manual_seed(0)
    kw = {"weights": None, "weights_backbone": None, "num_classes": 11}
    if "320" not in name and not name.startswith("ssd"):
        kw.update(min_size=224, max_size=224)
    model = getattr(torchvision.models.detection, name)(**kw).eval()
    if weights == "normal":
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
    if thresh == "0":
        owner = model.roi_heads if hasattr(model, "roi_heads") else model
        owner.score_thresh = 0.0
    images = [torch.rand(3, 200, 240), torch.rand(3, 180, 160)]
    if weights == "random64":
        model, images = model.double(), [i.double() for i in images]
    return model, images


def _leaves(out, prefix=""):
    import torch

    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, dict):
        return [leaf for k, v in out.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(out, list | tuple):
        return [leaf for i, v in enumerate(out) for leaf in _leaves(v, f"{prefix}[{i}]")]
    return []


def _compare(ref, got) -> tuple[str, str]:
    """("match", "") or ("differs", first differing output and its error)."""
    a, b = _leaves(ref), _leaves(got)
    if [k for k, _ in a] != [k for k, _ in b]:
        return "differs", "output structure"
    for (key, r), (_, o) in zip(a, b, strict=True):
        if r.shape != o.shape:
            return "differs", f"{key}: shape {tuple(o.shape)} vs eager {tuple(r.shape)}"
        if r.numel() == 0:
            continue
        r64, o64 = r.double(), o.double()
        scale = r64.abs().max().item()
        diff = (r64 - o64).abs()
        close = (diff <= ATOL_SCALE * scale + RTOL * r64.abs()) | (r64.isnan() & o64.isnan())
        if not bool(close.all()):
            err = diff.nan_to_num(float("inf")).max().item()
            return "differs", f"{key}: max error {err:.3g} (largest value {scale:.3g})"
    return "match", ""


def _run_backend(model, images, ref, backend: str) -> dict:
    import torch
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    options = {"cache_dir": None} if backend == "tpu" else None
    if backend == "tpu":
        import tpuc

        tpuc.reset_stats()
    compiled = torch.compile(model, backend=backend, options=options)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            got = compiled(images)
    except Exception as e:  # recorded, the sweep goes on
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return {"status": "error", "detail": detail, "seconds": round(time.perf_counter() - t0, 1)}
    first = time.perf_counter() - t0
    status, detail = _compare(ref, got)
    row = {
        "status": status,
        "detail": detail,
        "seconds": round(first, 1),
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
    }
    if backend == "tpu":
        stats = tpuc.stats()
        row["fallback_ops"] = dict(stats["fallback_ops"])
        row["eager_reruns"] = stats["eager_reruns"]
    return row


def run_one(name: str, weights: str, thresh: str, backends: str) -> dict:
    """{backend: row} for the comma-separated `backends`, in one process (one eager reference)."""
    import torch

    model, images = _build(name, weights, thresh)
    with torch.no_grad():
        ref = model(images)
    return {b: _run_backend(model, images, ref, b) for b in backends.split(",")}


def _jobs(models):
    """(model, weights, thresh, backends) in priority order: tpu on the issue's two
    configurations, then in float64, Inductor and aot_eager (the bars), then the rest."""
    both = "tpu,aot_eager"
    jobs = [(m, "random", "default", "tpu") for m in models]
    jobs += [(m, "normal", "0", "tpu") for m in models]
    jobs += [(m, "random64", "default", "tpu") for m in models]
    jobs += [(m, "random", "default", "inductor") for m in models]
    jobs += [(m, "normal", "0", "inductor") for m in models]
    jobs += [(m, w, t, "aot_eager") for w, t in CONFIGS[:2] for m in models]
    jobs += [(m, w, t, both) for w, t in CONFIGS[2:4] for m in models]
    return jobs


def _selected(jobs, configs, backends):
    """`jobs` restricted to the configurations "WEIGHTS/THRESH" and backends asked for (all
    where None)."""
    out = []
    for m, w, t, bs in jobs:
        if configs is not None and f"{w}/{t}" not in configs:
            continue
        kept = [b for b in bs.split(",") if backends is None or b in backends]
        if kept:
            out.append((m, w, t, ",".join(kept)))
    return out


def _key(job) -> str:
    return "|".join(job)


def write_markdown(results: dict, models, path: Path) -> None:
    lines = [
        "# torchvision detection models vs eager (bench/sweep_detection.py)",
        "",
        "Every output tensor compared with eager (rtol 1e-4, atol 1e-4 x largest value). `random`:",
        "torchvision's initialization; `normal`: every parameter N(0, 0.05); thresh: the score",
        "threshold (default or 0); `random64`: `random` in float64. Seconds: the first call",
        "(trace and compile, caches off).",
        "tpu's extra columns: ops run in PyTorch, calls rerun in eager for a tie.",
        "",
    ]
    for weights, thresh in CONFIGS:
        lines += [
            f"## weights {weights}, score_thresh {thresh}",
            "",
            "| model | tpu | s | aot_eager | s | inductor | s | tpu graphs | tpu fallbacks | reruns |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in models:
            cells = []
            tpu = results.get(_key((m, weights, thresh, "tpu")))
            for b in BACKENDS:
                r = results.get(_key((m, weights, thresh, b)))
                if r is None:
                    cells += ["not run", ""]
                    continue
                text = r["status"] + (f" ({r['detail']})" if r.get("detail") else "")
                cells += [text.replace("|", "/"), str(r.get("seconds", ""))]
            fallbacks = ", ".join(
                f"{k.split('.')[1] if '.' in k else k} x{v}"
                for k, v in (tpu or {}).get("fallback_ops", {}).items()
            )
            cells += [str((tpu or {}).get("graphs", "")), fallbacks, str((tpu or {}).get("eager_reruns", ""))]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    # Notes written by hand below the tables ("## Notes ...") stay.
    old = path.read_text() if path.exists() else ""
    notes = old[old.index("\n## Notes") + 1 :] if "\n## Notes" in old else ""
    path.write_text("\n".join(lines) + notes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--budget", type=float, default=5400)
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "WEIGHTS", "THRESH", "BACKENDS"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--configs", nargs="*", metavar="WEIGHTS/THRESH", help="only these, e.g. normal/0")
    ap.add_argument("--backends", nargs="*", choices=BACKENDS, help="only these backends")
    args = ap.parse_args()
    if args.one:
        import warnings

        warnings.simplefilter("ignore")
        print("RESULT " + json.dumps(run_one(*args.one)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / "detection.json", args.out / "detection.md"
    results = json.loads(json_path.read_text()) if json_path.exists() else {}
    start = time.perf_counter()
    for job in _selected(_jobs(args.models), args.configs, args.backends):
        if all(_key((*job[:3], b)) in results for b in job[3].split(",")):
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < 60:
            break
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", *job],
                capture_output=True,
                text=True,
                timeout=min(args.timeout, left),
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is not None:
                rows = json.loads(line[len("RESULT ") :])
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                rows = {
                    b: {"status": "crashed", "detail": f"rc {proc.returncode}: {tail[:200]}"}
                    for b in job[3].split(",")
                }
        except subprocess.TimeoutExpired:
            rows = {
                b: {"status": "timeout", "detail": f"over {min(args.timeout, left):.0f} s"}
                for b in job[3].split(",")
            }
        for b, row in rows.items():
            results[_key((*job[:3], b))] = row
        print(job, rows, flush=True)
        json_path.write_text(json.dumps(results, indent=1, sort_keys=True))
        write_markdown(results, MODELS, md_path)  # every model's row, whichever ran


if __name__ == "__main__":
    main()
