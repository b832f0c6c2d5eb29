"""Compiling many executables in several processes at once (`tpuc.precompile`, opt-in).

With `TPUC_COMPILE_PROCESSES=N` (N > 1), precompile hands its jobs (an IR graph and its size
bindings each) to N worker processes that load only tpuc's extension (no torch, ~0.1 s to start),
each with its own PJRT client, compiling its share into the shared disk cache; this process then
loads every executable from disk. Entries are written atomically and verified on read (cache/),
so racing workers are safe. Off by default: measured on this 2-core machine, one XLA CPU compile
already keeps both cores busy (6.4 CPU s in 3.2 s wall for 8 buckets), so workers only add their
start-up (bench/results/cache.md); they are for hosts with more cores than one compile uses.

Worker: `python -m tpuc.compile_workers` reads a pickled job list on stdin and prints one JSON line
per finished job: {"job": i, "cache": "miss" | "disk" | "memory"} or {"job": i, "error": text}.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path


def process_count(n_jobs: int, cache_dir) -> int:
    """How many worker processes to use: `TPUC_COMPILE_PROCESSES` (default 1: compile in this
    process), at most one per job; 1 without a disk cache or with fewer than 2 jobs."""
    from .runtime import positive_int_env

    if not os.environ.get("TPUC_COMPILE_PROCESSES"):  # unset or empty: this process
        return 1
    n = positive_int_env("TPUC_COMPILE_PROCESSES", 1)
    if cache_dir is None or n_jobs < 2:
        return 1
    return min(n, n_jobs)


def compile_in_workers(
    jobs: list, plugin, precision: str, cache_dir, cache_max_bytes, processes: int, progress=False
):
    """Compiles `jobs` ([(FxGraph, bindings dict)]) into the disk cache with `processes` worker
    processes (job k goes to worker k mod processes). Returns per job what the worker's cache
    did ("miss" = it compiled). A worker's error raises `TpucError` naming the job."""
    from . import _native

    shares = [list(range(w, len(jobs), processes)) for w in range(processes)]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    outcomes: list = [None] * len(jobs)
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def run(share: list[int]) -> None:
        payload = pickle.dumps(
            {
                "plugin": plugin,
                "precision": precision,
                "cache_dir": str(cache_dir),
                "cache_max_bytes": cache_max_bytes,
                "jobs": [(i, jobs[i][0], jobs[i][1]) for i in share],
            }
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpuc.compile_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        err_lines: list[bytes] = []
        drain = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
        drain.start()
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at start: its exit status says so below
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            with lock:
                if "error" in rec:
                    errors.append(f"job {rec['job']}: {rec['error']}")
                else:
                    outcomes[rec["job"]] = rec["cache"]
                done[0] += 1
                if progress:
                    print(f"\rtpuc: compiling {done[0]}/{len(jobs)}", end="", file=sys.stderr, flush=True)
        code = proc.wait()
        drain.join()
        if code != 0:
            tail = b"".join(err_lines)[-2000:].decode(errors="replace")
            with lock:
                errors.append(f"compile worker exited with status {code}: {tail}")

    def guarded(share: list[int]) -> None:
        try:
            run(share)
        except Exception as e:  # e.g. the interpreter cannot be started: reported, not lost
            with lock:
                errors.append(f"compile worker: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=guarded, args=(share,)) for share in shares if share]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if progress:
        print(file=sys.stderr)
    if errors:
        raise _native.TpucError("tpuc: parallel compile failed: " + "; ".join(errors))
    return outcomes


def _worker() -> int:
    from . import runtime

    job = pickle.load(sys.stdin.buffer)
    rt = runtime.get_runtime(job["plugin"])
    for i, graph, bindings in job["jobs"]:
        try:
            (exe,) = rt.compile_many(
                graph, [bindings], job["precision"], job["cache_dir"], job["cache_max_bytes"]
            )
            rec = {"job": i, "cache": exe.cache}
        except Exception as e:  # reported to the parent, which raises it
            rec = {"job": i, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
