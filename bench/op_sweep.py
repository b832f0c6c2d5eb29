"""Op coverage sweep: PyTorch's own OpInfo database through `torch.compile`, aot_eager vs tpuc.

For every OpInfo of `torch.testing._internal.common_methods_invocations.op_db` (CPU, float32), the
first --samples sample inputs (`op.sample_inputs("cpu", torch.float32, requires_grad=False)`) are run
in eager PyTorch and through `torch.compile(fn, backend=B, dynamic=False, fullgraph=True)` for
B = "aot_eager" (PyTorch's reference backend) and B = "tpu" with options={"fallback": "error"}, where
`fn(input, args, kwargs)` calls the op. Every compiled output is compared with eager by
`torch.testing.assert_close(..., equal_nan=True)`.

Per op and backend the status is `pass` (every sample matches), `fail-mismatch` or `fail-error`
(the first failing sample decides; the reason is the unsupported ATen op for
`tpuc.UnsupportedOpError`, else the exception type and the first line of its message). tpuc is run
on every sample even after a failure, and every ATen op its graphs lack (not only the first one
the error names) is recorded, so the ranked "missing ATen ops" list is complete.

Excluded (listed with the reason, not counted): ops without float32 on CPU; ops with random or
uninitialized outputs (a fixed name list, the OpInfo flags `has_nondeterministic_output` and
`skip_correctness_check_compile_vs_eager`, and any op whose eager output differs between two runs
on identical inputs with different RNG seeds); ops whose output has a non-tensor leaf; ops where
eager fails on every chosen sample. A sample on which eager fails is dropped (recorded in the
JSON); the op is swept with the remaining samples.

Tolerances (float32): PyTorch's defaults rtol=1.3e-6, atol=1e-5, raised to the largest
`toleranceOverride` / `precisionOverride` for float32 that the OpInfo declares for CPU (or any
device) in its decorators (CUDA/MPS-only and gradient-test overrides ignored). Two families are
relaxed further because XLA legitimately reorders their arithmetic: reductions over products
(matmul/conv/attention/distances/norms/sums/scans: rtol=1e-5, atol=1e-4) and linear algebra,
FFT and special functions (rtol=atol=1e-4). The same tolerance applies to both backends. A
mismatch records the largest absolute and relative error.

Isolation: tpuc's executable cache goes to a temporary folder (TPUC_CACHE_DIR), removed at the
end; ops run in --jobs worker processes (spawned, default 1), one op at a time per worker,
`torch._dynamo.reset()` before every compiled sample; each backend of an op is limited to
--timeout seconds (signal.alarm) and the whole op to a hard limit after which the parent kills the
worker and starts a new one; a worker that dies (segfault, abort) marks the op's current backend
as crashed. The sweep itself never stops on an op's failure.

    .venv/bin/python bench/op_sweep.py [--ops add mm ...] [--limit N] [--samples 3] [--jobs 1]
                                       [--timeout 60] [--threads N] [--out bench/results] [--update]

The full sweep (703 OpInfos) takes about 25 minutes with --jobs 2 on 2 CPUs. --update reruns only
the selected ops (e.g. `--ops cumsum sort --update`, after adding lowering rules) and merges them
into the existing OUT/op_sweep.json, rewriting both reports.

Writes OUT/op_sweep.json (per op, per backend, per sample) and OUT/op_sweep.md (summary, failing
ops for tpu with reasons, missing ATen ops ranked by the number of swept ops each one blocks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
import traceback
import types
import unittest
from collections import Counter, deque
from itertools import islice
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("aot_eager", "tpu")
BACKEND_OPTIONS = {"tpu": {"fallback": "error"}}
SEED = 0

DEFAULT_RTOL, DEFAULT_ATOL = 1.3e-6, 1e-5
# Reductions over products or long sums: XLA may reorder them (rtol, atol).
REDUCTION_TOL = (1e-5, 1e-4)
REDUCTION_OPS = {
    "addbmm", "addmm", "addmm.decomposed", "addmv", "addr", "baddbmm", "bmm", "bmm.triton_optimized", "dot",
    "vdot", "mv", "mm", "matmul", "__rmatmul__", "inner", "tensordot", "einsum", "kron", "outer",
    "cdist", "dist", "cov", "corrcoef", "trace", "cumsum", "cumprod", "logcumsumexp", "cumulative_trapezoid",
    "trapz", "trapezoid", "sum", "nansum", "mean", "nanmean", "prod", "std", "std.unbiased", "var",
    "var.unbiased", "var_mean", "var_mean.unbiased", "std_mean", "std_mean.unbiased", "logsumexp",
    "softmax", "softmax.with_dtype", "log_softmax", "log_softmax.with_dtype", "norm", "norm.fro",
    "norm.inf", "renorm", "sum_to_size", "nn.functional.linear", "nn.functional.bilinear",
    "nn.functional.scaled_dot_product_attention", "nn.functional.multi_head_attention_forward",
    "nn.functional.pdist", "nn.functional.pairwise_distance", "nn.functional.cosine_similarity",
    "nn.functional.normalize", "nn.functional.layer_norm", "nn.functional.group_norm",
    "nn.functional.instance_norm", "nn.functional.batch_norm", "nn.functional.rms_norm",
    "nn.functional.local_response_norm", "native_layer_norm", "native_group_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_batch_norm_with_update", "nn.functional.embedding_bag",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.kl_div",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "torch.ops.aten._safe_softmax.default",
}  # fmt: skip
REDUCTION_PREFIXES = (
    "nn.functional.conv",
    "nn.functional.unfold",
    "masked.",
    "linalg.vecdot",
    "linalg.multi_dot",
)
# Linear algebra, FFT and special functions: different algorithms/approximations (rtol, atol).
ALGORITHM_TOL = (1e-4, 1e-4)
ALGORITHM_OPS = {
    "cholesky_inverse", "cholesky_solve", "lu", "lu_solve", "lu_unpack", "matrix_exp", "pinverse", "svd",
    "svd_lowrank", "pca_lowrank", "logdet", "geqrf", "ormqr", "triangular_solve", "norm.nuc", "lgamma",
    "digamma", "erfinv", "i0", "igamma", "igammac", "sinc",
}  # fmt: skip
ALGORITHM_PREFIXES = ("linalg.", "fft.", "special.", "polygamma.", "mvlgamma.", "signal.windows.")

# Random or uninitialized outputs (OpInfo names, variant included); see also the OpInfo flags.
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "multinomial", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "nn.functional.rrelu", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "svd_lowrank",
    "pca_lowrank", "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
    "new_empty_strided",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Worker side: runs ops (imports torch, op_db, tpuc).
# --------------------------------------------------------------------------------------------


def _load_op_db():
    """op_db, importable without the `expecttest` package (only a base class is needed from it)."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        stub.ACCEPT = False
        sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def op_tolerance(op, key: str) -> tuple[float, float, str]:
    """(rtol, atol, where it comes from) for float32 on CPU."""
    import torch
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    rtol, atol, sources = DEFAULT_RTOL, DEFAULT_ATOL, ["float32 default"]
    if key in ALGORITHM_OPS or key.startswith(ALGORITHM_PREFIXES):
        (rtol, atol), sources = ALGORITHM_TOL, ["algorithm family"]
    elif key in REDUCTION_OPS or key.startswith(REDUCTION_PREFIXES):
        (rtol, atol), sources = REDUCTION_TOL, ["reduction family"]
    for info in getattr(op, "decorators", ()) or ():
        if isinstance(info, DecorateInfo):
            dev = info.device_type
            if dev is not None and dev != "cpu" and not (isinstance(dev, list | tuple) and "cpu" in dev):
                continue
            if info.dtypes is not None and torch.float32 not in info.dtypes:
                continue
            if info.active_if is False:
                continue
            if info.cls_name in ("TestGradients", "TestFwdGradients", "TestBwdGradients", "TestConsistency"):
                continue
            decorators = info.decorators
        else:
            decorators = [info]
        for dec in decorators:
            if isinstance(dec, toleranceOverride) and torch.float32 in dec.d:
                t = dec.d[torch.float32]
                if t.rtol > rtol or t.atol > atol:
                    rtol, atol = max(rtol, t.rtol), max(atol, t.atol)
                    sources.append("OpInfo toleranceOverride")
            elif isinstance(dec, precisionOverride) and torch.float32 in dec.d:
                if dec.d[torch.float32] > atol:
                    atol = dec.d[torch.float32]
                    sources.append("OpInfo precisionOverride")
    return rtol, atol, " + ".join(dict.fromkeys(sources))


class OpTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise OpTimeout("per-op time limit reached")


def _seed(s: int) -> None:
    import numpy as np
    import torch

    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def _samples(op, n: int) -> list:
    """The first n sample inputs, identical (values and strides) at every call."""
    import torch

    _seed(SEED)
    return list(islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), n))


def _call(op, sample):
    return op.op(sample.input, *sample.args, **sample.kwargs)


def _leaves(out):
    """Flat list of output leaves; None when a leaf is not a tensor."""
    import torch
    import torch.utils._pytree as pytree

    leaves = pytree.tree_leaves(out)
    if not leaves and not isinstance(out, list | tuple):
        return None
    if all(isinstance(x, torch.Tensor) for x in leaves):
        return leaves
    return None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return text[:240]


def _unwrap(e: BaseException) -> BaseException:
    """The backend's own exception out of Dynamo's wrappers."""
    from torch._dynamo.exc import BackendCompilerFailed

    seen = 0
    while isinstance(e, BackendCompilerFailed) and seen < 5:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None:
            break
        e, seen = inner, seen + 1
    return e


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {_first_line(e)}"


def _max_errors(actual, expected) -> tuple[float, float]:
    import torch

    try:
        a, b = actual.detach(), expected.detach()
        if a.shape != b.shape:
            return math.nan, math.nan
        if a.is_complex() or b.is_complex():
            a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
        a, b = a.to(torch.float64), b.to(torch.float64)
        both_nan = torch.isnan(a) & torch.isnan(b)
        diff = (a - b).abs().masked_fill(both_nan, 0)
        same_inf = (a == b) & torch.isinf(a)
        diff = diff.masked_fill(same_inf, 0)
        if diff.numel() == 0:
            return 0.0, 0.0
        rel = diff / b.abs().clamp_min(1e-30)
        return float(diff.max()), float(rel.masked_fill(diff == 0, 0).max())
    except Exception:
        return math.nan, math.nan


def _compare(actual_out, expected_leaves, rtol, atol) -> tuple[str, str, dict]:
    """(status, reason, details) of a compiled output against eager's."""
    import torch

    leaves = _leaves(actual_out)
    if leaves is None:
        return "fail-mismatch", f"non-tensor output {type(actual_out).__name__}", {}
    if len(leaves) != len(expected_leaves):
        return "fail-mismatch", f"{len(leaves)} outputs, eager has {len(expected_leaves)}", {}
    for i, (a, b) in enumerate(zip(leaves, expected_leaves, strict=True)):
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
        except AssertionError as e:
            abs_err, rel_err = _max_errors(a, b)
            if a.dtype != b.dtype:
                reason = f"output {i}: dtype {a.dtype} vs eager {b.dtype}"
            elif a.shape != b.shape:
                reason = f"output {i}: shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
            else:
                reason = (
                    f"output {i}: max abs err {abs_err:.3g}, max rel err {rel_err:.3g} ({_first_line(e)})"
                )
            return "fail-mismatch", reason, {"max_abs_err": abs_err, "max_rel_err": rel_err, "output": i}
    return "pass", "", {}


def _same(a_leaves, b_leaves) -> bool:
    import torch

    if len(a_leaves) != len(b_leaves):
        return False
    for a, b in zip(a_leaves, b_leaves, strict=True):
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
    return True


class _UnsupportedRecorder:
    """Records every node tpuc's compile hook finds unsupported (the error only names the first)."""

    def __init__(self):
        self.ops: list[str] = []
        try:
            import tpuc.compile_hook as tb

            self._orig = tb._unsupported_nodes
            tb._unsupported_nodes = self._wrapped
            self.active = True
        except Exception:
            self.active = False

    def _wrapped(self, gm):
        bad = self._orig(gm)
        self.ops.extend(str(n.target) for n in bad)
        return bad


def _unsupported_from_message(msg: str) -> list[str]:
    # "unsupported op `aten.foo.default` (node `foo`): ..."
    if "unsupported op `" in msg:
        return [msg.split("unsupported op `", 1)[1].split("`", 1)[0]]
    return []


_GAP = re.compile(r"cannot lower node `[^`]*` \(op `([^`]+)`\): (.*)")


def _lowering_gap(e: BaseException) -> str | None:
    """'aten.op: what the rule rejects' for a tpuc lowering rule that refuses a variant of its op."""
    import tpuc

    if not isinstance(e, tpuc.TpucError) or isinstance(e, tpuc.UnsupportedOpError | tpuc.PjrtError):
        return None
    m = _GAP.search(str(e).strip().splitlines()[0] if str(e).strip() else "")
    return f"{m.group(1)}: {m.group(2).strip()}" if m else None


def run_op(op, n_samples: int, backends, timeout: int, recorder, send_partial) -> dict:
    import torch

    key = op_key(op)
    res: dict = {"op": key, "name": op.name, "variant": op.variant_test_name, "excluded": None}
    t_op = time.perf_counter()

    def excluded(reason: str) -> dict:
        res["excluded"] = reason
        res["seconds"] = round(time.perf_counter() - t_op, 3)
        return res

    if torch.float32 not in op.supported_dtypes("cpu"):
        return excluded("no float32 on CPU")
    if key in RANDOM_OPS or op.name in RANDOM_OPS:
        return excluded("random/uninitialized output (name list)")
    if getattr(op, "has_nondeterministic_output", False):
        return excluded("random/uninitialized output (OpInfo has_nondeterministic_output)")
    if getattr(op, "skip_correctness_check_compile_vs_eager", False):
        return excluded("random output (OpInfo skip_correctness_check_compile_vs_eager)")

    rtol, atol, tol_src = op_tolerance(op, key)
    res["tolerance"] = {"rtol": rtol, "atol": atol, "source": tol_src}

    # Eager reference, twice with different RNG seeds: random outputs show up as a difference.
    signal.alarm(timeout)
    try:
        try:
            samples = _samples(op, n_samples)
        except Exception as e:
            return excluded(f"sample_inputs failed: {_describe(e)}")
        if not samples:
            return excluded("no sample inputs")
        expected: dict[int, list] = {}
        eager_failures = {}
        for i, s in enumerate(samples):
            try:
                _seed(1000 + i)
                out = _call(op, s)
            except OpTimeout:
                raise
            except Exception as e:
                eager_failures[i] = _describe(e)
                continue
            leaves = _leaves(out)
            if leaves is None:
                return excluded(f"non-tensor output ({type(out).__name__})")
            expected[i] = [t.detach().clone() if t.layout == torch.strided else t for t in leaves]
        if eager_failures:
            res["eager_failed_samples"] = eager_failures
        if not expected:
            return excluded(f"eager fails on every sample ({next(iter(eager_failures.values()))})")
        again = _samples(op, n_samples)
        for i in expected:
            _seed(2000 + i)
            leaves = _leaves(_call(op, again[i]))
            if leaves is None or not _same(leaves, expected[i]):
                return excluded("random output (eager differs between two runs)")
    except OpTimeout:
        return excluded(f"eager exceeds the {timeout}s limit")
    except Exception as e:
        return excluded(f"eager reference failed: {_describe(e)}")
    finally:
        signal.alarm(0)
    res["samples"] = sorted(expected)
    res["backends"] = {}
    send_partial(res, None)

    for backend in backends:
        send_partial(res, backend)
        t0 = time.perf_counter()
        per_sample = []
        missing: list[str] = []
        gaps: list[str] = []
        signal.alarm(timeout)
        try:
            samples = _samples(op, n_samples)
            for i in sorted(expected):
                s = samples[i]
                recorder.ops.clear()
                torch._dynamo.reset()

                def fn(inp, args, kwargs):
                    return op.op(inp, *args, **kwargs)

                compiled = torch.compile(
                    fn, backend=backend, options=BACKEND_OPTIONS.get(backend), dynamic=False, fullgraph=True
                )
                entry = {"sample": i}
                try:
                    out = compiled(s.input, s.args, s.kwargs)
                except (OpTimeout, KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # also pyo3's PanicException (a BaseException)
                    inner = _unwrap(e)
                    import tpuc

                    if backend == "tpu" and isinstance(inner, tpuc.UnsupportedOpError):
                        ops = list(dict.fromkeys(recorder.ops)) or _unsupported_from_message(str(inner))
                        missing.extend(ops)
                        entry.update(
                            status="fail-error", reason=f"unsupported {', '.join(ops)}", unsupported=ops
                        )
                    else:
                        entry.update(status="fail-error", reason=_describe(inner))
                        gap = _lowering_gap(inner) if backend == "tpu" else None
                        if gap:
                            gaps.append(gap)
                            entry["lowering_gap"] = gap
                        if inner is not e:
                            entry["wrapped_in"] = type(e).__name__
                    per_sample.append(entry)
                    continue
                status, reason, details = _compare(out, expected[i], rtol, atol)
                entry.update(status=status, reason=reason, **details)
                per_sample.append(entry)
        except OpTimeout:
            per_sample.append({"sample": None, "status": "fail-error", "reason": f"timeout: over {timeout}s"})
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            per_sample.append(
                {"sample": None, "status": "fail-error", "reason": f"sweep error: {_describe(e)}"}
            )
        finally:
            signal.alarm(0)
            torch._dynamo.reset()
        first_fail = next((p for p in per_sample if p["status"] != "pass"), None)
        result = {
            "status": first_fail["status"] if first_fail else "pass",
            "reason": first_fail["reason"] if first_fail else "",
            "seconds": round(time.perf_counter() - t0, 3),
            "per_sample": per_sample,
        }
        if missing:
            result["unsupported_ops"] = sorted(set(missing))
        if gaps:
            result["lowering_gaps"] = sorted(set(gaps))
        res["backends"][backend] = result
    res["seconds"] = round(time.perf_counter() - t_op, 3)
    return res


def worker_main(conn, n_samples: int, backends, timeout: int, threads: int | None) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import torch

    if threads:
        torch.set_num_threads(threads)
    op_db = _load_op_db()
    import tpuc  # noqa: F401  (the backend's error types; registers nothing needed)

    ops = {op_key(op): op for op in op_db}
    recorder = _UnsupportedRecorder()
    signal.signal(signal.SIGALRM, _alarm)
    conn.send(("ready", None))

    def send_partial(res, stage):
        conn.send(("partial", (json.loads(json.dumps(res, default=str)), stage)))

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        key = msg[1]
        try:
            res = run_op(ops[key], n_samples, backends, timeout, recorder, send_partial)
        except BaseException as e:  # never let the worker die of a Python exception
            res = {"op": key, "excluded": f"sweep error: {_describe(e)}", "traceback": traceback.format_exc()}
        conn.send(("result", json.loads(json.dumps(res, default=str))))


# --------------------------------------------------------------------------------------------
# Parent side: schedules ops on workers, survives their crashes, writes the results.
# --------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.start()

    def start(self):
        parent, child = self.ctx.Pipe()
        self.conn = parent
        self.proc = self.ctx.Process(
            target=worker_main,
            args=(child, self.args.samples, tuple(self.args.backends), self.args.timeout, self.args.threads),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.key = None
        self.partial = None
        self.stage = None
        self.deadline = None

    def assign(self, key: str, hard_limit: float):
        self.key, self.partial, self.stage = key, None, "eager"
        self.deadline = time.monotonic() + hard_limit
        self.conn.send(("run", key))

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


def _crash_result(w: Worker, why: str, backends) -> dict:
    """The result of an op whose worker died or hung: what was done, the current stage failed."""
    res = dict(w.partial or {"op": w.key, "excluded": None})
    if w.stage in (None, "eager") and not res.get("backends"):
        res["excluded"] = f"eager reference {why}"
        return res
    res.setdefault("backends", {})
    for b in backends:
        if b not in res["backends"]:
            reason = why if b == w.stage else f"not run ({w.stage} {why})"
            res["backends"][b] = {"status": "fail-error", "reason": reason, "per_sample": []}
    return res


def sweep(args, keys: list[str], checkpoint=None) -> dict:
    """Runs `keys` on the workers; `checkpoint(results, seconds)` is called about once a minute."""
    ctx = mp.get_context("spawn")
    hard_limit = args.timeout * (len(args.backends) + 1) + 120
    workers = [Worker(ctx, args) for _ in range(min(args.jobs, len(keys)))]
    pending = deque(keys)
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    last_write = time.monotonic()

    def finish(w: Worker, res: dict):
        results[w.key] = res
        w.key = None
        done = len(results)
        b = res.get("backends") or {}
        line = res["excluded"] and f"excluded: {res['excluded']}"
        line = line or "  ".join(
            f"{k}={v['status']}" + (f" ({v['reason'][:90]})" if v["reason"] else "") for k, v in b.items()
        )
        eta = (time.monotonic() - t0) / done * (len(keys) - done)
        print(
            f"[{done}/{len(keys)} {time.monotonic() - t0:6.0f}s eta {eta:5.0f}s] {res['op']}: {line}",
            flush=True,
        )

    while pending or any(w.key for w in workers):
        for w in workers:
            if w.ready and w.key is None and pending:
                w.assign(pending.popleft(), hard_limit)
        waitables = [w.conn for w in workers] + [w.proc.sentinel for w in workers]
        wait(waitables, timeout=5)
        for w in workers:
            died = False
            try:
                while w.conn.poll():
                    kind, payload = w.conn.recv()
                    if kind == "ready":
                        w.ready = True
                    elif kind == "partial":
                        w.partial, w.stage = payload
                    elif kind == "result":
                        finish(w, payload)
            except (EOFError, OSError):
                died = True
            if died or not w.proc.is_alive():
                code = w.proc.exitcode
                if w.key is not None:
                    finish(w, _crash_result(w, f"crashed: worker died (exit code {code})", args.backends))
                elif not w.ready:
                    print(f"worker failed to start (exit code {code})", file=sys.stderr)
                    if time.monotonic() - w.started < 5:
                        raise SystemExit("op_sweep: worker cannot start; run with a working .venv")
                w.kill()
                w.start()
            elif w.key is not None and time.monotonic() > w.deadline:
                w.kill()
                finish(
                    w, _crash_result(w, f"hung: killed after the hard limit of {hard_limit}s", args.backends)
                )
                w.start()
        if time.monotonic() - last_write > 60:
            if checkpoint is not None:
                checkpoint(results, time.monotonic() - t0)
            last_write = time.monotonic()
    for w in workers:
        try:
            w.conn.send(("stop",))
        except OSError:
            pass
        w.proc.join(10)
        w.kill()
    return results


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def _tpu_category(r: dict) -> str:
    """Why tpu fails on an op: missing-op, lowering-gap, mismatch or error."""
    t = r.get("backends", {}).get("tpu", {})
    if t.get("unsupported_ops"):
        return "missing-op"
    if t.get("lowering_gaps") and t.get("status") == "fail-error":
        return "lowering-gap"
    return "mismatch" if t.get("status") == "fail-mismatch" else "error"


def summarize(keys, results) -> dict:
    swept = [k for k in keys if k in results and not results[k].get("excluded")]
    excluded = [k for k in keys if k in results and results[k].get("excluded")]

    def status(k, b):
        return results[k].get("backends", {}).get(b, {}).get("status")

    aot_pass = [k for k in swept if status(k, "aot_eager") == "pass"]
    tpu_pass = [k for k in aot_pass if status(k, "tpu") == "pass"]
    tpu_pass_all = [k for k in swept if status(k, "tpu") == "pass"]
    tpu_fail = [k for k in aot_pass if status(k, "tpu") != "pass"]

    def ranked(field):
        blocked: dict[str, list[str]] = {}
        sole: Counter = Counter()
        for k in aot_pass:
            items = results[k]["backends"].get("tpu", {}).get(field) or []
            for m in items:
                blocked.setdefault(m, []).append(k)
            if len(items) == 1:
                sole[items[0]] += 1
        order = sorted(blocked, key=lambda m: (-len(blocked[m]), -sole[m], m))
        return [
            {"op": m, "blocks": len(blocked[m]), "sole_blocker": sole[m], "swept_ops": blocked[m]}
            for m in order
        ]

    return {
        "ops_in_db": len(keys),
        "swept": len(swept),
        "excluded": len(excluded),
        "aot_eager_pass": len(aot_pass),
        "tpu_pass_of_aot_eager_pass": len(tpu_pass),
        "tpu_pass_total": len(tpu_pass_all),
        "percentage": round(100.0 * len(tpu_pass) / len(aot_pass), 2) if aot_pass else None,
        "target_percentage": 95.0,
        "tpu_failures_by_category": dict(Counter(_tpu_category(results[k]) for k in tpu_fail)),
        "missing_aten_ops": ranked("unsupported_ops"),
        "lowering_gaps": ranked("lowering_gaps"),
    }


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _meta(args, keys, results, seconds: float, partial: bool) -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "samples_per_op": args.samples,
        "timeout_s": args.timeout,
        "jobs": args.jobs,
        "backends": {b: BACKEND_OPTIONS.get(b) for b in args.backends},
        "ops_selected": len(keys),
        "ops_done": len(results),
        "seconds": round(seconds, 1),
        "partial": partial,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "tolerances": {
            "default": {"rtol": DEFAULT_RTOL, "atol": DEFAULT_ATOL},
            "reduction_family": {"rtol": REDUCTION_TOL[0], "atol": REDUCTION_TOL[1]},
            "algorithm_family": {"rtol": ALGORITHM_TOL[0], "atol": ALGORITHM_TOL[1]},
            "opinfo_overrides": "max of float32 toleranceOverride/precisionOverride for CPU or any device",
        },
        "tpuc_build": getattr(args, "build", None) or _build_info(),
        "updates": [],
    }


def _build_info() -> dict:
    """Which tpuc was swept: git HEAD, uncommitted changes, the extension's build time."""
    import subprocess

    info: dict = {}
    try:
        git = ["git", "-C", str(ROOT)]
        info["git_head"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        info["uncommitted_files"] = len(dirty.stdout.splitlines())
    except OSError:
        pass
    try:
        import importlib.util

        so = importlib.util.find_spec("tpuc._native").origin
        mtime = datetime.datetime.fromtimestamp(os.path.getmtime(so), datetime.UTC)
        info["native_built"] = mtime.isoformat(timespec="seconds")
    except Exception:
        pass
    return info


def write_outputs(out_dir, meta: dict, keys, results) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summ = summarize(keys, results)
    ordered = {k: results[k] for k in keys if k in results}
    data = {"meta": meta, "summary": summ, "ops": ordered}
    for name, text in (
        ("op_sweep.json", json.dumps(data, indent=1, default=str) + "\n"),
        ("op_sweep.md", render_md(meta, summ, keys, results)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def render_md(meta, summ, keys, results) -> str:
    def st(k, b):
        return results[k].get("backends", {}).get(b, {})

    pct = summ["percentage"]
    cats = summ["tpu_failures_by_category"]
    lines = [
        "# Op sweep: PyTorch OpInfo database through torch.compile",
        "",
        f"{meta['date']}: torch {meta['torch']}, {meta['cpus']} CPUs, CPU float32, first "
        f"{meta['samples_per_op']} sample inputs per op, `dynamic=False, fullgraph=True`; tpu with "
        f"`options={{'fallback': 'error'}}`; {meta['seconds']:.0f} s for {meta['ops_done']} ops with "
        f"{meta['jobs']} job(s)" + (" (PARTIAL: sweep still running)" if meta["partial"] else "") + ". "
        f"Command: `{meta['command']}`.",
    ]
    b = meta.get("tpuc_build") or {}
    if b:
        lines.append(
            f"tpuc: git {b.get('git_head')} with {b.get('uncommitted_files')} uncommitted file(s), "
            f"extension built {b.get('native_built')}."
        )
    for u in meta.get("updates", []):
        lines.append(f"Updated {u['date']}: {u['ops']} op(s) rerun by `{u['command']}`.")
    lines += [
        "",
        "| | ops |",
        "|---|---:|",
        f"| ops selected from op_db | {summ['ops_in_db']} |",
        f"| excluded (no float32, random, non-tensor output, eager fails) | {summ['excluded']} |",
        f"| swept | {summ['swept']} |",
        f"| aot_eager passes | {summ['aot_eager_pass']} |",
        f"| tpu passes, of those | {summ['tpu_pass_of_aot_eager_pass']} |",
        f"| **tpu / aot_eager** | **{pct if pct is not None else '-'}%** (target >= 95%) |",
        f"| tpu passes, all swept ops | {summ['tpu_pass_total']} |",
        "",
        "tpu failures among the ops aot_eager passes: "
        f"{cats.get('missing-op', 0)} missing ATen op(s), "
        f"{cats.get('lowering-gap', 0)} lowering rule rejects a variant, "
        f"{cats.get('mismatch', 0)} mismatch(es), {cats.get('error', 0)} other error(s).",
        "",
        "Tolerances: float32 defaults (rtol 1.3e-6, atol 1e-5), raised to the OpInfo's own float32 "
        "overrides for CPU; reductions/matmul/conv family rtol 1e-5, atol 1e-4; linalg/fft/special "
        "rtol = atol = 1e-4 (see bench/op_sweep.py). Status `pass` means every sample matched.",
        "",
    ]
    for field, title, head in (
        ("missing_aten_ops", "Missing ATen ops", "ATen op"),
        ("lowering_gaps", "Lowering rules that reject a variant of their op", "op: what the rule rejects"),
    ):
        items = summ[field]
        lines += [
            f"## {title} ({len(items)}), ranked by swept ops they block",
            "",
            "Counted over the ops aot_eager passes; `sole` = ops for which it is the only blocker of its kind.",
            "",
            f"| rank | {head} | blocks | sole | swept ops (first 8) |",
            "|---:|---|---:|---:|---|",
        ]
        for i, m in enumerate(items, 1):
            ops = ", ".join(m["swept_ops"][:8]) + (" ..." if len(m["swept_ops"]) > 8 else "")
            lines.append(
                f"| {i} | `{_md_escape(m['op'])}` | {m['blocks']} | {m['sole_blocker']} | {_md_escape(ops)} |"
            )
        lines.append("")

    done = [k for k in keys if k in results and not results[k].get("excluded")]
    aot_ok = [k for k in done if st(k, "aot_eager").get("status") == "pass"]
    tpu_fail = [k for k in aot_ok if st(k, "tpu").get("status") != "pass"]
    bugs = [k for k in tpu_fail if _tpu_category(results[k]) in ("mismatch", "error")]
    lines += [
        f"## tpu mismatches and errors other than coverage ({len(bugs)})",
        "",
        "| op | status | reason |",
        "|---|---|---|",
    ]
    for k in bugs:
        s = st(k, "tpu")
        lines.append(f"| {k} | {s.get('status')} | {_md_escape(s.get('reason', ''))[:300]} |")
    lines += [
        "",
        f"## All tpu failures among ops aot_eager passes ({len(tpu_fail)})",
        "",
        "| op | status | reason |",
        "|---|---|---|",
    ]
    for k in tpu_fail:
        s = st(k, "tpu")
        lines.append(f"| {k} | {s.get('status')} | {_md_escape(s.get('reason', ''))[:200]} |")
    aot_fail = [k for k in done if st(k, "aot_eager").get("status") != "pass"]
    lines += [
        "",
        f"## aot_eager failures ({len(aot_fail)}, not counted) and tpu on them",
        "",
        "| op | aot_eager | tpu |",
        "|---|---|---|",
    ]
    for k in aot_fail:
        a, t = st(k, "aot_eager"), st(k, "tpu")
        ar = f"{a.get('status')}: {a.get('reason', '')}"[:160]
        tr = f"{t.get('status')}" + (f": {t.get('reason', '')}" if t.get("reason") else "")
        lines.append(f"| {k} | {_md_escape(ar)} | {_md_escape(tr[:160])} |")
    excl = [k for k in keys if k in results and results[k].get("excluded")]
    lines += ["", f"## Excluded ({len(excl)})", "", "| op | reason |", "|---|---|"]
    for k in excl:
        lines.append(f"| {k} | {_md_escape(str(results[k]['excluded']))[:200]} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=None, help="OpInfo names (`name` or `name.variant`) to sweep")
    p.add_argument("--limit", type=int, default=None, help="only the first N ops (after --ops)")
    p.add_argument("--samples", type=int, default=3, help="sample inputs per op (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output folder")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--timeout", type=int, default=60, help="seconds per op and backend (default 60)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in workers")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument(
        "--update",
        action="store_true",
        help="merge into the existing OUT/op_sweep.json: rerun the selected ops, keep every other op's row",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "aot_eager" not in args.backends:
        print("note: without aot_eager the summary percentage is undefined", file=sys.stderr)
    op_db = _load_op_db()
    all_keys = [op_key(op) for op in op_db]
    keys = list(all_keys)
    if args.ops:
        wanted = set(args.ops)
        keys = [k for k, op in zip(all_keys, op_db, strict=True) if k in wanted or op.name in wanted]
        unknown = wanted - set(keys) - {op.name for op in op_db}
        if unknown:
            print(f"unknown op(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
    if args.limit is not None:
        keys = keys[: args.limit]
    args.build = _build_info()  # before the sweep: a rebuild during it does not reach running workers
    previous = None
    if args.update:
        path = Path(args.out) / "op_sweep.json"
        if not path.exists():
            print(f"--update: {path} does not exist", file=sys.stderr)
            return 2
        previous = json.loads(path.read_text())
    print(
        f"op_sweep: {len(keys)} ops, {args.samples} samples each, backends {args.backends}, {args.jobs} job(s)"
    )
    t0 = time.monotonic()
    checkpoint = None
    if previous is None:

        def checkpoint(done, secs):
            write_outputs(args.out, _meta(args, keys, done, secs, partial=True), keys, done)

    # A private, throw-away executable cache: the sweep neither fills nor reads the user's.
    with tempfile.TemporaryDirectory(prefix="tpuc-op-sweep-") as cache_dir:
        os.environ["TPUC_CACHE_DIR"] = cache_dir
        results = sweep(args, keys, checkpoint) if keys else {}
    seconds = time.monotonic() - t0
    if previous is None:
        report_keys, meta = keys, _meta(args, keys, results, seconds, partial=False)
    else:
        meta = previous["meta"]
        meta.setdefault("updates", []).append(
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "ops": len(keys),
                "seconds": round(seconds, 1),
                "tpuc_build": args.build,
            }
        )
        results = {**previous["ops"], **results}
        report_keys = [k for k in all_keys if k in results]
        meta["ops_done"] = len(report_keys)
    write_outputs(args.out, meta, report_keys, results)
    s = summarize(report_keys, results)
    print(
        f"\n{s['swept']} ops swept ({s['excluded']} excluded); aot_eager passes {s['aot_eager_pass']}; "
        f"tpu passes {s['tpu_pass_of_aot_eager_pass']} of those = {s['percentage']}% (target 95%); "
        f"{seconds:.0f} s. Wrote {Path(args.out) / 'op_sweep.json'} and op_sweep.md"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
