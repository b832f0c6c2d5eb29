"""A process that imports torch and tpuc once, then forks child processes on request, so that the
cache tests can start many processes without paying about 7 CPU seconds of imports for each.

No PJRT client, executable or cache folder exists in the zygote: each child loads the plugin,
compiles and reads or writes the cache on its own, as a separately started process would.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.
  {"op": "start", "entry": "model" | "cli", "argv": [...], "env": {...}, "cwd": DIR | null,
   "out": PREFIX}  -> {"pid": PID}   child's stdout/stderr go to PREFIX.out / PREFIX.err
  {"op": "poll", "pid": PID}  -> {"exit": CODE or null (running)}
  {"op": "wait", "pid": PID}  -> {"exit": CODE}   (a negative code: killed by that signal)
`entry` "model" runs run_model.main(argv); "cli" runs tpuc.cli.main(argv) (the `tpuc` command).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_model  # noqa: E402  (imports torch and tpuc)

from tpuc import cli  # noqa: E402


def _child(req: dict) -> int:
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(req["out"] + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update(req.get("env") or {})
    if req.get("cwd"):
        os.chdir(req["cwd"])
    sys.argv = ["tpuc" if req["entry"] == "cli" else "run_model.py", *req["argv"]]
    main = cli.main if req["entry"] == "cli" else run_model.main
    return main(req["argv"])


def main() -> int:
    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(req)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            answer = {"pid": pid}
        elif req["op"] == "poll":
            pid, status = os.waitpid(req["pid"], os.WNOHANG)
            answer = {"exit": os.waitstatus_to_exitcode(status) if pid else None}
        elif req["op"] == "wait":
            _, status = os.waitpid(req["pid"], 0)
            answer = {"exit": os.waitstatus_to_exitcode(status)}
        else:
            answer = {"error": f"unknown op {req['op']!r}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
