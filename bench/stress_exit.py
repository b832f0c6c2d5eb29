"""Exit stress: many short fresh processes that compile, run and exit, and two-process gloo runs,
each checked for an abnormal end (a signal such as SIGABRT, a nonzero status, a hang past its
deadline, or "terminate called" / "Fatal Python error" / a Rust panic on stderr), optionally with
busy loops keeping the cores loaded.

    .venv/bin/python bench/stress_exit.py [--runs 20] [--busy 1] [--jobs 1] [--kinds ...]

Kinds (each run is a fresh process, or two for the gloo kinds):
  infer    inference of a small conv + MLP + layer-norm model (host oneDNN, BLAS and row kernels
           on the CPU plugin), then exit
  train    a training step of the same model (forward, backward, SGD step), then exit
  daemon   a daemon thread still calling a compiled model while the main thread exits
  workers  tpuc.precompile with TPUC_COMPILE_PROCESSES=2 (compile worker processes), then exit
  ddp      two gloo processes: DDP around a compiled model, 2 steps, destroy_process_group, exit
  fsdp2    two gloo processes: FSDP2 with compiled block forwards, 2 steps, destroy, exit

Writes bench/results/stress_exit.json and bench/results/stress_exit.md (newest run on top);
`--out PATH` writes the JSON there instead and no Markdown. Exit status 1 when any process ended
abnormally. `tests/test_exit.py` runs the short form (`--short`)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KINDS = ["infer", "train", "daemon", "workers", "ddp", "fsdp2"]
TWO_PROCESS = {"ddp", "fsdp2"}
# Short form (tests/test_exit.py): a few compile-run-exit processes and two gloo runs. Not the
# daemon kind: a daemon thread caught in torch's own frames when the interpreter exits can abort
# there whatever tpuc does (aot_eager did, in 1 of 4 runs), and `make test` must not fail by chance.
SHORT = {"infer": 2, "train": 1, "ddp": 1, "fsdp2": 1}
DEADLINE_S = 300  # one run (both processes of a gloo run); a normal run takes seconds
BAD_STDERR = ("terminate called", "Fatal Python error", "panicked at", "Segmentation fault")


# --- children (fresh processes) ---------------------------------------------------------------


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    # Sized so that each host kernel of the CPU plugin runs: the convolution in oneDNN, the
    # products (>= 2^18 multiply-adds) in the host BLAS, the layer norm in the row kernels.
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 256),
        nn.LayerNorm(256),
        nn.GELU(),
        nn.Linear(256, 10),
    )


def _child_local(kind: str) -> None:
    import threading

    import torch

    import tpuc

    model = _model()
    x = torch.randn(8, 3, 16, 16)
    if kind == "workers":
        tpuc.precompile(model.eval(), (x,), dynamic={0: {0: 8}}, buckets=[2, 4, 8])
        return
    f = torch.compile(model, backend="tpu")
    if kind == "infer":
        with torch.no_grad():
            out = f(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    elif kind == "train":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            f(x).square().mean().backward()
            opt.step()
    elif kind == "daemon":
        with torch.no_grad():
            f(x)
        calls = [0]

        def spin():
            with torch.no_grad():
                while True:
                    f(x)
                    calls[0] += 1

        threading.Thread(target=spin, daemon=True).start()
        while calls[0] < 3:
            time.sleep(0.01)
    else:
        raise ValueError(kind)


def _child_gloo(kind: str, rank: int, port: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        import tpuc  # noqa: F401  (the backend)

        torch.manual_seed(0)
        blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
        )
        model = nn.Sequential(*blocks, nn.Linear(32, 4))
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            module = DDP(torch.compile(model, backend="tpu"))
        else:
            from torch.distributed.fsdp import fully_shard

            for block in blocks:
                fully_shard(block)
                block.forward = torch.compile(block.forward, backend="tpu")
            module = fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(2):
            opt.zero_grad()
            module(torch.randn(4, 32, generator=g)).square().mean().backward()
            opt.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _child(argv: list[str]) -> int:
    kind = argv[0]
    if kind in TWO_PROCESS:
        _child_gloo(kind, int(argv[1]), int(argv[2]))
    else:
        _child_local(kind)
    print(f"{kind}: done", flush=True)
    return 0


# --- parent -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(kind: str, cache_dir: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # The children import this checkout's tpuc, as the parent does.
    package_root = str(ROOT / "python")
    if (ROOT / "python" / "tpuc").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("TPUC_CACHE_DIR", cache_dir)
    if kind in TWO_PROCESS:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if kind == "workers":
        env["TPUC_COMPILE_PROCESSES"] = "2"
    return env


def _start(kind: str, cache_dir: str) -> list[subprocess.Popen]:
    """The process(es) of one run of `kind`, started."""
    cmds = [[sys.executable, __file__, "--child", kind]]
    if kind in TWO_PROCESS:
        port = _free_port()
        cmds = [[sys.executable, __file__, "--child", kind, str(rank), str(port)] for rank in range(2)]
    return [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(kind, cache_dir),
            text=True,
            errors="replace",
        )
        for cmd in cmds
    ]


def _finish(kind: str, procs: list[subprocess.Popen], started: float) -> dict:
    """Waits for one run (killing it past the deadline) and classifies how each process ended."""
    outcome = {"kind": kind, "codes": [], "hang": False, "bad_output": [], "tail": ""}
    for p in procs:
        left = max(1.0, started + DEADLINE_S - time.monotonic())
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            outcome["hang"] = True
            p.kill()
            out, _ = p.communicate()
        outcome["codes"].append(p.returncode)
        bad = [s for s in BAD_STDERR if s in out]
        outcome["bad_output"] += bad
        if p.returncode != 0 or bad:
            outcome["tail"] += out[-3000:]
    outcome["seconds"] = round(time.monotonic() - started, 2)
    outcome["abort"] = any(c < 0 for c in outcome["codes"]) and not outcome["hang"]
    outcome["ok"] = (
        all(c == 0 for c in outcome["codes"]) and not outcome["bad_output"] and not outcome["hang"]
    )
    return outcome


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """`n` processes that keep one core each busy (a pure-Python loop) until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(kinds: dict[str, int], busy: int, jobs: int, progress: bool = True) -> dict:
    """Runs `kinds` ({kind: runs}) with `jobs` runs at a time and `busy` busy loops beside them."""
    # Round robin over the kinds, so that a slow kind does not come in one block.
    queue = [k for i in range(max(kinds.values(), default=0)) for k, n in kinds.items() if i < n]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    outcomes: list[dict] = []
    loops = _busy_loops(busy)
    try:
        with tempfile.TemporaryDirectory(prefix="tpuc-stress-exit-") as cache_dir:
            running: list[tuple[str, list, float]] = []
            while queue or running:
                while queue and len(running) < jobs:
                    kind = queue.pop(0)
                    running.append((kind, _start(kind, cache_dir), time.monotonic()))
                kind, procs, started = running.pop(0)
                outcome = _finish(kind, procs, started)
                outcomes.append(outcome)
                if progress:
                    state = "ok" if outcome["ok"] else f"ABNORMAL {outcome['codes']} {outcome['bad_output']}"
                    print(f"{len(outcomes):4d} {kind:8s} {outcome['seconds']:6.1f} s  {state}", flush=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    wall = time.monotonic() - t0
    per_kind = {}
    for kind in kinds:
        mine = [o for o in outcomes if o["kind"] == kind]
        per_kind[kind] = {
            "runs": len(mine),
            "processes": sum(len(o["codes"]) for o in mine),
            "abnormal": sum(not o["ok"] for o in mine),
            "aborts": sum(o["abort"] for o in mine),
            "hangs": sum(o["hang"] for o in mine),
            "mean_s": round(sum(o["seconds"] for o in mine) / max(1, len(mine)), 2),
            "max_s": max((o["seconds"] for o in mine), default=0.0),
        }
    return {
        "kinds": per_kind,
        "runs": len(outcomes),
        "processes": sum(len(o["codes"]) for o in outcomes),
        "abnormal": sum(not o["ok"] for o in outcomes),
        "aborts": sum(o["abort"] for o in outcomes),
        "hangs": sum(o["hang"] for o in outcomes),
        "busy_loops": busy,
        "jobs": jobs,
        "cpus": os.cpu_count(),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "wall_s": round(wall, 1),
        "failures": [o for o in outcomes if not o["ok"]],
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(report: dict) -> str:
    lines = [
        f"# Exit stress: {report['runs']} runs ({report['processes']} processes), "
        f"{report['abnormal']} abnormal, {report['aborts']} aborts",
        "",
        f"{report['date']}, commit {report['commit']}, {report['cpus']} CPUs, {report['busy_loops']} busy "
        f"loop(s), {report['jobs']} run(s) at a time, load average {report['load_before'][0]} before / "
        f"{report['load_after'][0]} after, {report['wall_s']} s. Command: `{report['command']}`",
        "",
        "| kind | runs | processes | abnormal | aborts | hangs | mean s | max s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, k in report["kinds"].items():
        lines.append(
            f"| {kind} | {k['runs']} | {k['processes']} | {k['abnormal']} | {k['aborts']} | {k['hangs']} | "
            f"{k['mean_s']} | {k['max_s']} |"
        )
    for f in report["failures"]:
        lines += [
            "",
            f"- {f['kind']}: exit codes {f['codes']}, {f['bad_output']}",
            "",
            "```",
            f["tail"][-1500:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=20, help="runs of each kind")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    ap.add_argument("--short", action="store_true", help="the short form of tests/test_exit.py")
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the runs")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--out", help="write the JSON report here (and no Markdown)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child)

    kinds = dict(SHORT) if args.short else {k: args.runs for k in args.kinds}
    report = run(kinds, args.busy, args.jobs, progress=not args.quiet)
    report["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report["commit"] = _commit()
    report["command"] = " ".join(
        ["python", "bench/stress_exit.py", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    else:
        import results_history  # bench/, beside this script

        results = HERE / "results"
        (results / "stress_exit.json").write_text(json.dumps(report, indent=1) + "\n")
        results_history.write_markdown(results / "stress_exit.md", markdown(report))
    print(
        f"{report['runs']} runs, {report['processes']} processes: {report['abnormal']} abnormal "
        f"({report['aborts']} aborts, {report['hangs']} hangs), load {report['load_before'][0]} -> "
        f"{report['load_after'][0]}, {report['wall_s']} s"
    )
    return 1 if report["abnormal"] else 0


if __name__ == "__main__":
    sys.exit(main())
