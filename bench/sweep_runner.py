"""The harness the model sweeps share (bench/sweep_diffusers.py, bench/generate.py): one subprocess
per entry with a timeout, `--jobs` of them at a time, resumable JSON results written after every
entry, and a Markdown table.

A sweep script calls `main(...)` with its entry names and a `work(name) -> dict` function; the
child process (`script --one NAME`) runs `work(name)` and prints one `SWEEP_RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MARK = "SWEEP_RESULT "
RESULTS = Path(__file__).resolve().parent / "results"


def short_error(exc: BaseException, limit: int = 240) -> str:
    """The exception's type and the first line of its message that says something, shortened."""
    inner = getattr(exc, "inner_exception", None)  # Dynamo's BackendCompilerFailed wraps the real one
    if isinstance(inner, BaseException) and inner is not exc:
        return short_error(inner, limit)
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = next((ln for ln in lines if not ln.startswith(("Traceback", "File "))), "")
    msg = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def cell(v, none: str = "-") -> str:
    """A Markdown table cell: yes / **no** for booleans, `none` for None, text with its pipes
    escaped and its newlines joined."""
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return str(v).replace("|", "\\|").replace("\n", " ")


def error_cell(r: dict) -> str:
    """A result's error, with aot_eager's where it differs (the reference's failure is torch's)."""
    err, aot = r.get("error") or "", r.get("aot_eager_error") or ""
    text = f"{err} (aot_eager: {aot})" if err and aot and aot != err else err or aot
    return cell(text)


def table(header: list[str], rows: list[list], right: tuple[int, ...] = ()) -> list[str]:
    """Markdown table lines; `right`: the indices of right-aligned (numeric) columns."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def run_child(work: Callable[[str], dict], name: str) -> None:
    t0 = time.time()
    try:
        result = work(name)
    except Exception as e:  # noqa: BLE001 - a sweep records every failure
        traceback.print_exc()
        result = {"error": short_error(e)}
    result.setdefault("name", name)
    result["wall_s"] = round(time.time() - t0, 2)
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)


def _spawn(script: Path, name: str, timeout: float, extra: list[str]) -> dict:
    """Runs one entry in a child process. `timeout` limits its CPU seconds (RLIMIT_CPU), not its
    wall time, so a child that waits for the CPU on a shared machine is not cut short; 4x the
    limit in wall time stops it anyway."""
    import resource
    import signal

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout), int(timeout) + 5))

    t0 = time.time()
    cmd = [sys.executable, str(script), "--one", name, *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {
            "name": name,
            "error": f"timeout after {4 * timeout:.0f} s",
            "wall_s": round(time.time() - t0, 2),
        }
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return {
            "name": name,
            "error": f"timeout after {timeout:.0f} CPU s",
            "wall_s": round(time.time() - t0, 2),
        }
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {
        "name": name,
        "error": f"child exited {proc.returncode}: " + " | ".join(tail)[-300:],
        "wall_s": round(time.time() - t0, 2),
    }


def main(
    *,
    script: str,
    title: str,
    stem: str,
    names: list[str],
    work: Callable[[str], dict],
    markdown: Callable[[list[dict]], str],
    default_timeout: float = 600,
    priority: tuple[str, ...] = (),
) -> None:
    """`priority`: entries run first (the rest follow in `names` order)."""
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--one", help="run one entry in this process and print its result (the child mode)")
    p.add_argument("--only", nargs="*", help="entries to run (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="entries run at once (one process each)")
    p.add_argument("--timeout", type=float, default=default_timeout, help="CPU seconds per entry")
    p.add_argument("--fresh", action="store_true", help="discard the results file and run every entry again")
    p.add_argument("--out", default=str(RESULTS / stem), help="results path without extension")
    args = p.parse_args()
    if args.fresh and args.only:
        p.error("--only already reruns its entries and keeps the others; --fresh would discard them")
    if args.one:
        run_child(work, args.one)
        return

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_suffix(".json")
    done: dict[str, dict] = {}
    if json_path.exists() and not args.fresh:
        done = {r["name"]: r for r in json.loads(json_path.read_text())["results"]}
    first = [n for n in priority if n in names]
    ordered = first + [n for n in names if n not in first]
    todo = [n for n in (args.only or ordered) if args.fresh or args.only or n not in done]
    unknown = sorted(set(todo) - set(names))
    if unknown:
        sys.exit(f"unknown entries: {unknown}")
    print(f"{title}: {len(todo)} to run, {len(done)} already done, {args.jobs} at a time", flush=True)

    order = {n: i for i, n in enumerate(names)}

    def save() -> None:
        results = sorted(done.values(), key=lambda r: order.get(r["name"], len(order)))
        meta = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
        try:
            import torch

            meta["torch"] = torch.__version__
        except ImportError:
            pass
        json_path.write_text(json.dumps({"title": title, "meta": meta, "results": results}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(results))

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {n: pool.submit(_spawn, Path(script), n, args.timeout, []) for n in todo}
        for i, (name, fut) in enumerate(futures.items(), 1):
            r = fut.result()
            done[name] = r
            save()
            status = r.get("error") or "ok"
            print(f"[{i}/{len(todo)}] {name}: {status} ({r.get('wall_s')} s)", flush=True)
    save()
