"""Large f32 matrix products run in PyTorch's own BLAS
(MKL) as XLA FFI custom calls (`tpuc_sgemm_nn|nt|tn|tt`) inside the compiled program, registered
with the CPU plugin at start (`TPUC_HOST_KERNELS=-gemm`: never). Checked against eager for every operand
layout (plain, transposed weight as in nn.Linear, transposed input, batched), with bias and
scaling (addmm), and through the disk cache (a second process loads the executables, the handler
registered before they run), cut into row blocks (many rows) or column blocks (fewer rows) on
XLA's threads. Small and non-f32 products stay in XLA. Each
case runs in its own process: the setting is read once, when the process's runtime starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MKL = (Path(torch.__file__).parent / "lib" / "libtorch_cpu.so").is_file() and "mkl" in (
    torch.__config__.show().lower()
)
pytestmark = pytest.mark.skipif(not MKL, reason="PyTorch here is not built with MKL")

CHILD = r"""
import os, pathlib, sys, torch, tpuc
if sys.argv[2:] == ["pieces"]:
    tpuc._native.set_host_gemm_always_pieces(True)
torch.manual_seed(0)
dump = pathlib.Path(sys.argv[1])
lin = torch.nn.Linear(256, 384)
cases = {
    "mm": (lambda a, b: a @ b, (torch.randn(600, 256), torch.randn(256, 320))),
    "linear": (lambda x: torch.relu(lin(x)), (torch.randn(2, 300, 256),)),
    "a_transposed": (lambda a, b: a.t() @ b, (torch.randn(256, 520), torch.randn(256, 320))),
    "both_transposed": (lambda a, b: a.t() @ b.t(), (torch.randn(256, 4), torch.randn(320, 256))),
    "bmm": (lambda a, b: torch.bmm(a, b), (torch.randn(3, 512, 96), torch.randn(3, 96, 160))),
    "addmm_scaled": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
                     (torch.randn(320), torch.randn(2, 1024), torch.randn(1024, 320))),
    "vector_matrix": (lambda a, b: a @ b, (torch.randn(1, 1024), torch.randn(1024, 1536))),
    "mid_rows": (lambda a, b: a @ b, (torch.randn(128, 1024), torch.randn(1024, 320))),
    "mid_rows_transposed": (lambda a, b: a.t() @ b.t(), (torch.randn(768, 200), torch.randn(450, 768))),
    "mid_rows_narrow": (lambda a, b: a @ b, (torch.randn(256, 1024), torch.randn(1024, 100))),
    "bmm_mid_rows": (lambda a, b: torch.bmm(a, b.transpose(1, 2)), (torch.randn(1, 200, 96), torch.randn(1, 320, 96))),
    # B's rows 12 KB / 4 KB apart at 128 / 96 rows: pieces pack B first (`wants_packed_b`).
    "b_rows_4kb_apart": (lambda a, b: a @ b, (torch.randn(128, 768), torch.randn(768, 3072))),
    "b_rows_4kb_apart_a_transposed": (lambda a, b: a.t() @ b, (torch.randn(300, 96), torch.randn(300, 1024))),
    "small": (lambda a, b: a @ b, (torch.randn(8, 16), torch.randn(16, 8))),
    "float64": (lambda a, b: a @ b, (torch.randn(600, 256, dtype=torch.float64), torch.randn(256, 320, dtype=torch.float64))),
}
with torch.no_grad():
    for name, (fn, args) in cases.items():
        d = dump / name
        out = torch.compile(fn, backend="tpu", options={"dump_dir": str(d)})(*args)
        torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-4)
        text = "".join(p.read_text() for p in d.rglob("stablehlo.mlir"))
        print(name, "tpuc_sgemm" in text)
s = tpuc.stats()
print("xla_compiles", s["xla_compiles"], "disk_hits", s["cache_hits_disk"])
inline, pieces, packed = tpuc._native.Runtime.host_gemm_calls()
print("pieces", pieces)
print("packed", packed)
from tpuc import runtime
print("min_macs", runtime.get_runtime(None).host_gemm_min_macs)
"""

# The cases that run in the host BLAS.
HOST = (
    "mm",
    "linear",
    "a_transposed",
    "both_transposed",
    "bmm",
    "addmm_scaled",
    "vector_matrix",
    "mid_rows",
    "mid_rows_transposed",
    "mid_rows_narrow",
    "bmm_mid_rows",
    "b_rows_4kb_apart",
    "b_rows_4kb_apart_a_transposed",
)


def _run(tmp_path: Path, name: str, host_kernels: str | None, pieces: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TPUC_HOST_KERNELS", None)
    if host_kernels is not None:
        env["TPUC_HOST_KERNELS"] = host_kernels
    env["TPUC_CACHE_DIR"] = str(tmp_path / f"cache-{host_kernels}-{pieces}")
    dump = tmp_path / name
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(dump), *(["pieces"] if pieces else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln.split(" ", 1) for ln in r.stdout.splitlines() if ln.strip()]
    return {k: v for k, v in lines}


def test_host_gemm_matches_eager_in_every_layout_and_loads_from_the_disk_cache(tmp_path):
    first = _run(tmp_path, "first", None)
    for name in HOST:
        assert first[name] == "True", (name, first)
    # Products below HOST_GEMM_MIN_MACS, and f64: XLA's dot.
    assert first["small"] == "False", first
    assert first["float64"] == "False", first
    assert first["min_macs"] == str(1 << 18), first
    # A second process finds every executable on disk and runs the custom calls in them.
    second = _run(tmp_path, "second", None)
    assert second["mm"] == "True"
    assert second["xla_compiles"].startswith("0 "), second


def test_host_gemm_in_one_thread_pieces_over_xlas_pool_matches_eager(tmp_path):
    # The path of products met on XLA's threads (row blocks for many rows or few columns,
    # column blocks for fewer rows), forced on the calling thread: every layout still matches
    # eager.
    out = _run(tmp_path, "pieces", None, pieces=True)
    for name in HOST:
        assert out[name] == "True", (name, out)
    assert int(out["pieces"]) >= len(HOST), out
    # The two products with B's rows a multiple of 4 KB apart, each in two column pieces.
    assert int(out["packed"]) == 4, out


def test_host_gemm_off_keeps_every_product_in_xla(tmp_path):
    out = _run(tmp_path, "off", "-gemm")
    assert out["mm"] == "False" and out["vector_matrix"] == "False", out
    assert out["min_macs"] == "None", out


CONCURRENT = r"""
import threading, torch, tpuc
tpuc._native.set_host_gemm_always_pieces(True)
torch.manual_seed(0)
shapes = [(600, 256, 320), (128, 1024, 320), (64, 512, 512)]
fns = [torch.compile(lambda a, b: torch.relu(a @ b), backend="tpu") for _ in shapes]
inputs = [[(torch.randn(m, k), torch.randn(k, n)) for _ in range(4)] for m, k, n in shapes]
bad = []

def worker(i):
    for r in range(12):
        a, b = inputs[i][r % 4]
        out = fns[i](a, b)
        if not torch.allclose(out, torch.relu(a @ b), rtol=1e-5, atol=1e-4):
            bad.append((i, r))

for i in range(len(shapes)):
    fns[i](*inputs[i][0])  # compile one at a time
threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(shapes))]
for t in threads: t.start()
for t in threads: t.join()
print("bad", bad, "pieces", tpuc._native.Runtime.host_gemm_calls()[1])
"""


def test_host_gemm_pieces_from_several_threads_at_once_match_eager(tmp_path):
    """Products cut into pieces on three Python threads at once: each posts its blocks for the
    helper threads (one board: a later product replaces an earlier one there, whose owner then
    finishes it alone), and every result matches eager."""
    env = dict(os.environ, TPUC_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TPUC_HOST_KERNELS", None)
    r = subprocess.run(
        [sys.executable, "-c", CONCURRENT], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("bad [] pieces "), r.stdout + r.stderr
    assert int(line.split()[-1]) >= 3 * 12, line
