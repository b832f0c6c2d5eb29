"""torch.distributed around tpuc: two CPU processes on gloo over loopback train a small MLP stack for
3 SGD steps, each on half of every batch, and end with the parameters of one eager process that
trains the same model on the whole batches (1e-5). Patterns: DDP around a compiled module, and FSDP2
with every block's forward compiled after `fully_shard`. Each test also runs the same workers with
backend="aot_eager" (same processes, after tpu) as a baseline, so a mismatch points at tpuc and not
at the test. Each run is a pair of subprocesses with a deadline: a hang fails instead of blocking."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

WORLD = 2
STEPS = 3
BATCH = 8  # whole batch; each rank trains on BATCH // WORLD rows
HIDDEN = 32
LR = 0.1
TOL = 1e-5
DEADLINE_S = 240  # both workers, all backends; a normal run takes a fraction of this
BACKENDS = ["tpu", "aot_eager"]


class Block(nn.Module):
    """Pre-norm residual MLP block: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d=HIDDEN):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, d=HIDDEN, blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return Stack()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)
    ]


def _train(module, params, batches):
    opt = torch.optim.SGD(params, lr=LR)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()


def _eager_reference():
    model = _model()
    _train(model, model.parameters(), _batches())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- worker (runs in a subprocess: python test_distributed.py MODE RANK PORT OUTDIR) ---------------


def _worker(mode, rank, port, outdir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        import tpuc

        rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        batches = [(x[rows], y[rows]) for x, y in _batches()]
        for backend in BACKENDS:
            torch._dynamo.reset()
            tpuc.reset_stats()
            model = _model()
            if mode == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                module = DDP(torch.compile(model, backend=backend))
            elif mode == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                    block.forward = torch.compile(block.forward, backend=backend)
                module = fully_shard(model)
            else:
                raise ValueError(mode)
            start = time.perf_counter()
            _train(module, model.parameters(), batches)
            seconds = time.perf_counter() - start
            params = {}
            for n, p in model.named_parameters():
                p = p.detach()
                params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()
            stats = tpuc.stats()
            torch.save(
                {"params": params, "graphs_compiled": stats["graphs_compiled"], "seconds": seconds},
                Path(outdir) / f"{backend}-{rank}.pt",
            )
            print(f"rank {rank}: {backend} done", flush=True)
        # Neither rank tears gloo down while the other may still be in a collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: process group destroyed", flush=True)


# --- parent side ----------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(mode, outdir):
    """Starts WORLD workers and waits for all of them; kills all on a failure or past the deadline."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, __file__, mode, str(rank), str(port), str(outdir)]
        log = open(Path(outdir) / f"log-{rank}.txt", "w+")  # closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + DEADLINE_S
    failed = None
    while any(p.poll() is None for p, _ in procs):
        if any(p.poll() not in (None, 0) for p, _ in procs):
            failed = "a worker failed"
            break
        if time.monotonic() > deadline:
            failed = f"workers still running after {DEADLINE_S} s (hang?)"
            break
        time.sleep(0.2)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failed is None and any(p.returncode != 0 for p, _ in procs):
        failed = "a worker failed"
    logs = []
    for rank, (_, log) in enumerate(procs):
        log.seek(0)
        code = procs[rank][0].returncode
        logs.append(f"--- rank {rank} (exit code {code}) ---\n" + log.read()[-4000:])
        log.close()
    assert failed is None, f"{mode}: {failed}\n" + "\n".join(logs)


def _max_diff(a, b):
    """Largest absolute difference; NaN or inf anywhere counts as inf (NaN would compare as equal)."""
    d = (a - b).abs().max().item()
    return d if d == d else float("inf")


def _check(mode, tmp_path):
    _run_workers(mode, tmp_path)
    reference = _eager_reference()
    report, bad = [], []
    for backend in BACKENDS:
        for rank in range(WORLD):
            result = torch.load(tmp_path / f"{backend}-{rank}.pt")
            diffs = {n: _max_diff(result["params"][n], ref) for n, ref in reference.items()}
            worst = max(diffs, key=diffs.get)
            report.append(
                f"{backend} rank {rank}: max |param - eager| = {diffs[worst]:.3g} ({worst}; "
                f"{sum(d > TOL for d in diffs.values())}/{len(diffs)} parameters over {TOL}), "
                f"graphs_compiled={result['graphs_compiled']}, train {result['seconds']:.2f} s"
            )
            if diffs[worst] > TOL:
                bad.append(f"{backend} rank {rank}: {worst} differs from eager by {diffs[worst]:.3g}")
            if backend == "tpu" and result["graphs_compiled"] == 0:
                bad.append(f"tpu rank {rank}: tpuc compiled no graph")
    print("\n".join(report))
    assert not bad, "\n".join(bad + report)


def test_ddp_around_a_compiled_module_matches_one_eager_process(tmp_path):
    _check("ddp", tmp_path)


# Run again under TPUC_DEBUG=discrete_device: FSDP2 fills its unsharded parameters behind the version
# counter, which a discrete device's resident copies would miss (residency "auto" keeps none there).
@pytest.mark.discrete_device
def test_fsdp2_with_compiled_block_forwards_matches_one_eager_process(tmp_path):
    _check("fsdp2", tmp_path)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
