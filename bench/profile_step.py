"""Where a real-size training step's time goes on the CPU plugin, the step compiled whole (one
program) against the model compiled alone (the step split: forward and backward programs, the
update in PyTorch), side by side in one process: bench/bench_real.py's training cases.

    TPUC_DEBUG=profile_every=3 python bench/profile_step.py gpt2|resnet50 [--iters 4] [--dump DIR]

Per step (median over interleaved rounds): the wall time of each road; the PJRT execute time of
each program (`callprof`: the call's `execute` phase); for the whole step, the time in the
write-back of the state it updates (AOTAutograd's `_apply_mutations`: one `copy_` per parameter
and momentum buffer, timed by cProfile over `--iters` more steps); and, from the dumps, the host
kernels each program calls (`custom_call` targets) and the f32 bytes its XLA fusions write.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import logging
import pstats
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(case: str):
    """(model, inputs, pick) as bench_real.py builds its training cases (train mode)."""
    torch.manual_seed(0)
    if case == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config())
        return model.train(), (torch.randint(0, 50257, (1, 128)),), lambda o: o.logits
    import torchvision

    model = torchvision.models.resnet50()
    return model.train(), (torch.randn(8, 3, 224, 224),), lambda o: o


def make_step(model, inputs, pick, road: str, dump: Path):
    """bench_real.py's step (SGD with momentum): `road` "whole" compiles it, "split" the model."""
    m = copy.deepcopy(model)
    options = {"dump_dir": str(dump / road)}
    fn = torch.compile(m, backend="tpu", options=options) if road == "split" else m
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = pick(fn(*inputs)).float().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return torch.compile(step, backend="tpu", options=options) if road == "whole" else step


def dump_summary(folder: Path) -> dict:
    """Per graph of the last compile of each name: host kernel calls and XLA fusion writes."""
    out = {}
    for g in sorted(folder.glob("*_static")):
        name = g.name.split("_", 2)[2]
        text = (g / "stablehlo.mlir").read_text()
        kernels = collections.Counter(re.findall(r'call_target_name = "(tpuc_[a-z0-9_]+)"', text))
        hlo = (g / "optimized_hlo.txt").read_text() if (g / "optimized_hlo.txt").exists() else ""
        entry = hlo[hlo.find("\nENTRY") :]
        written, fusions = 0, 0
        for dims in re.findall(r"= f32\[([0-9,]*)\]\{[0-9,]*\} fusion\(", entry):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            written += 4 * n
            fusions += 1
        out[name] = {
            "host_kernels": dict(kernels),
            "dot_general": text.count('"stablehlo.dot_general"'),
            "fusions": fusions,
            "fusion_mb_written": written / 1e6,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=["gpt2", "resnet50"])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--dump", help="dump folder (default: a temporary one)")
    a = ap.parse_args()
    import tpuc
    from tpuc import callprof

    logging.getLogger("tpuc").setLevel(logging.DEBUG)  # times every call's phases (callprof)
    model, inputs, pick = build(a.case)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(a.dump or tmp)
        steps = {road: make_step(model, inputs, pick, road, dump) for road in ("whole", "split")}
        for road, s in steps.items():
            t = time.perf_counter()
            s()
            s()  # the second call compiles again once the optimizer's state exists
            print(f"{road}: first two calls {time.perf_counter() - t:.1f} s", flush=True)
        before = tpuc.stats()["executions"]
        steps["whole"]()
        print(f"whole: {tpuc.stats()['executions'] - before} program(s) per step")
        times = collections.defaultdict(list)
        for _ in range(a.iters):
            for road, s in steps.items():
                t = time.perf_counter()
                s()
                times[road].append(time.perf_counter() - t)
        for road, ts in times.items():
            print(
                f"{road}: median {statistics.median(ts) * 1e3:.0f} ms per step, {[round(x * 1e3) for x in ts]}"
            )
        for name, p in callprof.call_profiles().items():
            print(f"  {name}: {p['calls']} calls, execute median {p['execute'] / 1e3:.0f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.iters):
            steps["whole"]()
        prof.disable()
        stats = pstats.Stats(prof).stats
        for (_, _, func), (_, calls, _tottime, cumtime, _) in stats.items():
            if (
                func in ("<method 'copy_' of 'torch._C.TensorBase' objects>", "_apply_mutations")
                or "call_timed" in func
            ):
                print(
                    f"  whole, cProfile: {func}: {calls / a.iters:.0f} calls and {cumtime / a.iters * 1e3:.0f} ms per step"
                )
        for road in ("whole", "split"):
            for name, s in dump_summary(dump / road).items():
                print(f"  {road} {name}: {s}")


if __name__ == "__main__":
    main()
