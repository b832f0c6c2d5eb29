#!/usr/bin/env python
"""Which ops of training graphs a TPU target cannot lower: PyTorch's OpInfo samples and the
test zoo in train mode, forward and backward, through the target's lowering.

A target's graphs have no PyTorch escape (on the CPU plugin an op without a rule runs in
PyTorch): every op of every graph must lower. Compiling each graph with XLA:TPU would take
seconds per graph; this sweep stops at the lowering, which is what decides whether an op has a
rule for the target: each AOTAutograd graph (the backend's decompositions) is checked for nodes
without a rule (the check `options={"target": ...}` makes before compiling) and, when none, is
lowered for the target's devices by `_native.Target.lower` (the same lowering its compile runs,
without the compile), so a rule that rejects these operands is found too.

OpInfo: every op of `op_db` that supports autograd in float32 on CPU, its first --samples
samples with `requires_grad=True`; the outputs' floating leaves are summed and backpropagated.
Zoo: `zoo.training_setup(name)` (the model and its loss, train mode), one backward.

    .venv/bin/python bench/backward_sweep.py [--ops NAME ...] [--zoo NAME ...] [--no-opinfo]
        [--no-zoo] [--samples 2] [--target tpu:v5e:2x2] [--out bench/results]

Writes OUT/backward_sweep.json and OUT/backward_sweep.md (ops without a rule, ranked by how many
OpInfos / models they block; lowering errors; what could not be traced).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from collections import defaultdict
from itertools import islice
from pathlib import Path

os.environ.setdefault("TPUC_LOG", "error")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tpuc import fx_export, target_spec, targets  # noqa: E402
from tpuc.decompositions import _decompositions  # noqa: E402
from tpuc.op_support import _supported_ops, _unsupported_nodes, _why_unsupported  # noqa: E402

SEED = 0
OP_SECONDS = 120


class Checker:
    """A Dynamo backend that checks each AOTAutograd graph against the target's lowering and
    then runs it in PyTorch (so the backward is reached). `found` collects, per graph kind,
    {op: first node} without a rule and [(message)] lowering errors."""

    def __init__(self, target_name: str):
        self.spec = target_spec.parse(target_name)
        self.target = targets.get_target(self.spec)
        self.reset()

    def reset(self):
        self.missing: dict[str, set[str]] = defaultdict(set)
        self.errors: dict[str, list[str]] = defaultdict(list)
        self.graphs: dict[str, int] = defaultdict(int)

    def check(self, g: torch.fx.GraphModule, ins, kind: str) -> None:
        self.graphs[kind] += 1
        bad = _unsupported_nodes(g)
        if bad:
            for n in bad:
                if str(n.target) in _supported_ops:
                    self.errors[kind].append(f"{n.target}: {_why_unsupported(n)}")
                else:
                    self.missing[kind].add(str(n.target))
            return
        try:
            _t, _r, graph, *_ = fx_export.export_cleaned(g, None, texts=False)
            bindings = graph.bindings(
                [list(a.shape) if isinstance(a, torch.Tensor) else None for a in ins],
                [int(a) if not isinstance(a, torch.Tensor) else None for a in ins],
            )
            self.target.lower(graph, bindings, "highest")
        except Exception as e:  # noqa: BLE001 - every lowering failure is a finding
            op = getattr(e, "op", None)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            self.errors[kind].append(f"{op}: {first}" if op else f"{type(e).__name__}: {first}")

    def backend(self, gm, example_inputs):
        def compiler(kind):
            def one(g, ins):
                self.check(g, ins, kind)
                return make_boxed_func(g.forward)

            return one

        # Attention through the math path, as a target's compile takes it (targets.py).
        with sdpa_kernel(SDPBackend.MATH):
            return aot_module_simplified(
                gm,
                example_inputs,
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                decompositions=_decompositions(False),
            )


def _float_leaves(out) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]


def _backward(out) -> bool:
    leaves = _float_leaves(out)
    if not leaves:
        return False
    sum(t.sum() for t in leaves).backward()
    return True


def _alarm(signum, frame):
    raise TimeoutError(f"more than {OP_SECONDS} s")


def sweep_opinfo(checker: Checker, names: list[str] | None, n_samples: int) -> dict:
    from op_sweep import _load_op_db, _seed, op_key

    results = {}
    for op in _load_op_db():
        key = op_key(op)
        if names and op.name not in names and key not in names:
            continue
        if not op.supports_autograd or torch.float32 not in op.supported_backward_dtypes("cpu"):
            continue
        checker.reset()
        status, why = "ok", ""
        signal.alarm(OP_SECONDS)
        try:
            _seed(SEED)
            samples = list(islice(op.sample_inputs("cpu", torch.float32, requires_grad=True), n_samples))
            backwards = 0
            for s in samples:
                torch._dynamo.reset()

                def fn(inp, args, kwargs, op=op):
                    return op.op(inp, *args, **kwargs)

                compiled = torch.compile(fn, backend=checker.backend, dynamic=False, fullgraph=True)
                try:
                    out = compiled(s.input, s.args, s.kwargs)
                except Exception as e:  # noqa: BLE001
                    why = f"not traced: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                    continue
                try:
                    backwards += _backward(out)
                except Exception as e:  # noqa: BLE001
                    why = f"no backward: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            if not checker.graphs["backward"]:
                status = "skipped"
                why = why or "no backward graph"
        except Exception as e:  # noqa: BLE001
            status, why = "skipped", f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            signal.alarm(0)
        results[key] = _record(checker, status, why)
        print(f"{key:40s} {results[key]['status']:8s} {' '.join(results[key]['missing'])}", flush=True)
    return results


def sweep_zoo(checker: Checker, names: list[str] | None) -> dict:
    import zoo

    results = {}
    for name in names or zoo.NAMES:
        checker.reset()
        status, why = "ok", ""
        signal.alarm(OP_SECONDS * 3)
        try:
            torch._dynamo.reset()
            model, inputs = zoo.training_setup(name)
            loss = torch.compile(model, backend=checker.backend)(*inputs)
            loss.backward()
        except Exception as e:  # noqa: BLE001
            status, why = "skipped", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        finally:
            signal.alarm(0)
        results[name] = _record(checker, status, why)
        print(f"{name:40s} {results[name]['status']:8s} {' '.join(results[name]['missing'])}", flush=True)
    return results


def _record(checker: Checker, status: str, why: str) -> dict:
    missing = sorted(set().union(*checker.missing.values())) if checker.missing else []
    errors = [e for es in checker.errors.values() for e in es]
    if status == "ok" and (missing or errors):
        status = "fails"
    return {
        "status": status,
        "why": why,
        "graphs": dict(checker.graphs),
        "missing": missing,
        "missing_in": {k: sorted(v) for k, v in checker.missing.items()},
        "errors": sorted(set(errors)),
    }


def report(results: dict, target: str, seconds: float) -> str:
    lines = [
        "# Backward sweep: training graphs through a TPU target's lowering",
        "",
        f"`bench/backward_sweep.py`, {datetime.date.today()}, target {target}, {seconds:.0f} s. "
        "Every AOTAutograd graph (forward and backward) of PyTorch's OpInfo samples (float32, "
        "requires_grad) and of the test zoo in train mode, checked for nodes without a lowering rule "
        "and lowered for the target's devices (no XLA compile).",
        "",
    ]
    for part, res in results.items():
        counts = defaultdict(int)
        for r in res.values():
            counts[r["status"]] += 1
        lines += [f"## {part}", "", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), ""]
        blocked = defaultdict(list)
        for name, r in res.items():
            for op in r["missing"]:
                blocked[op].append(name)
        if blocked:
            lines += ["| op without a rule | graphs | blocks |", "|---|---|---|"]
            for op, who in sorted(blocked.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                kinds = sorted({k for n in who for k, v in res[n]["missing_in"].items() if op in v})
                lines.append(
                    f"| `{op}` | {', '.join(kinds)} | {len(who)}: {', '.join(who[:8])}{' ...' if len(who) > 8 else ''} |"
                )
            lines.append("")
        else:
            lines += ["Every op of every graph has a rule.", ""]
        errs = [(n, e) for n, r in res.items() for e in r["errors"]]
        if errs:
            lines += [
                "A rule that rejects these operands (complex values, data-dependent sizes, results it cannot compute):",
                "",
            ]
            lines += [f"- {n}: {e}" for n, e in errs]
            lines.append("")
        skipped = [(n, r["why"]) for n, r in res.items() if r["status"] == "skipped"]
        if skipped:
            lines += [f"Not swept ({len(skipped)}: no backward graph or not traceable by Dynamo):", ""]
            lines += [f"- {n}: {w}" for n, w in skipped]
            lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="*")
    ap.add_argument("--zoo", nargs="*")
    ap.add_argument("--no-opinfo", action="store_true")
    ap.add_argument("--no-zoo", action="store_true")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--target", default="tpu:v5e:2x2")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    torch.set_num_threads(1)
    checker = Checker(a.target)
    t = time.time()
    results = {}
    if not a.no_opinfo:
        results["OpInfo"] = sweep_opinfo(checker, a.ops, a.samples)
    if not a.no_zoo:
        results["zoo (train mode)"] = sweep_zoo(checker, a.zoo)
    seconds = time.time() - t
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backward_sweep.json").write_text(json.dumps({"target": a.target, "results": results}, indent=1))
    (out / "backward_sweep.md").write_text(report(results, a.target, seconds) + "\n")
    print(report(results, a.target, seconds))


if __name__ == "__main__":
    main()
