"""The persistent executable cache under real processes (issue 4): reuse across processes, racing
writers, a writer killed half-way, bad entries, eviction next to foreign files, a folder the
process cannot write, a folder others can write, the `tpuc cache` and `tpuc precompile` CLI.

Every process that matters is a real, separate process running tests/cache_helpers/run_model.py,
which checks its own results against eager PyTorch and prints a JSON report; caches live under
tmp_path. Most are forked from a zygote (tests/cache_helpers/zygote.py) that imported torch and
tpuc but holds no PJRT client nor cache state, so that some 30 processes fit the time budget of
two cores; test_second_process_loads_from_disk and the read-only test start fresh interpreters.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_helpers.blake3_ref import VECTORS, blake3
from models import make

import tpuc
from tpuc import _native, cli

TESTS = Path(__file__).resolve().parent
RUN_MODEL = TESTS / "cache_helpers" / "run_model.py"
ZYGOTE = TESTS / "cache_helpers" / "zygote.py"
TPUC_CLI = Path(sys.executable).parent / "tpuc"
HEADER_LEN = 8 + 4 + 32 + 8 + 8 + 32  # magic, version, key, meta len, payload len, checksum


def _env(**extra: str) -> dict:
    """The environment of a child: no cache settings inherited from the caller, one thread."""
    env = dict(os.environ)
    for k in (
        "TPUC_CACHE_DIR",
        "TPUC_CACHE_MAX_SIZE",
        "TPUC_DEBUG",
        "TPUC_LOG",
        "TPUC_DUMP_DIR",
    ):
        env.pop(k, None)
    # tpuc's disk cache alone: AOTAutograd's cache would hand a process the executables another
    # process compiled (tests/test_autograd_cache.py tests that).
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="0", **extra)
    return env


def _report(code: int, stdout: str, stderr: str) -> dict:
    assert code == 0, f"child failed (exit {code}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["ok"], report["errors"]
    report["stderr"] = stderr
    return report


def spawn_model(cache_dir: Path, *args: str, prefix: tuple = (), **env: str) -> dict:
    """Runs run_model.py in a freshly started interpreter; returns its report (stats,
    executables, stderr). Fails the test unless it exits 0 with results equal to eager."""
    proc = subprocess.run(
        [*prefix, sys.executable, str(RUN_MODEL), "--cache-dir", str(cache_dir), *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=600,
    )
    return _report(proc.returncode, proc.stdout, proc.stderr)


class Child:
    def __init__(self, zygote: Zygote, pid: int, out: str):
        self.zygote, self.pid, self.out = zygote, pid, out
        self.exit: int | None = None  # set once the zygote has reaped the child

    def poll(self) -> int | None:
        if self.exit is None:
            self.exit = self.zygote.request(op="poll", pid=self.pid)["exit"]
        return self.exit

    def wait(self) -> int:
        if self.exit is None:
            self.exit = self.zygote.request(op="wait", pid=self.pid)["exit"]
        return self.exit

    def kill(self) -> None:
        if self.exit is None:
            os.kill(self.pid, signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        return Path(self.out + ".out").read_text(), Path(self.out + ".err").read_text()

    def report(self) -> dict:
        return _report(self.wait(), *self.output())


class Zygote:
    """Starts processes forked from cache_helpers/zygote.py (torch and tpuc imported once)."""

    def __init__(self, outdir: Path):
        self.outdir, self.n = outdir, 0
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )

    def request(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return json.loads(line)

    def start(self, entry: str, argv: list[str], cwd: Path | None = None, **env: str) -> Child:
        self.n += 1
        out = str(self.outdir / f"child{self.n}")
        argv = [str(a) for a in argv]
        pid = self.request(op="start", entry=entry, argv=argv, env=env, cwd=cwd and str(cwd), out=out)["pid"]
        return Child(self, pid, out)

    def model(self, cache_dir: Path, *args: str, **env: str) -> dict:
        """Like spawn_model, in a forked process."""
        return self.start("model", ["--cache-dir", cache_dir, *args], **env).report()

    def cli(self, *argv: str, cwd: Path | None = None) -> tuple[int, str, str]:
        """Runs `tpuc ARGV...` (tpuc.cli.main) in a forked process: (exit code, stdout, stderr)."""
        child = self.start("cli", list(argv), cwd=cwd)
        return (child.wait(), *child.output())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def entries(d: Path) -> dict[str, int]:
    """{key: size} of the entry files in `d`."""
    return {p.name.removesuffix(".tpuc"): p.stat().st_size for p in d.glob("*.tpuc") if len(p.stem) == 64}


def temp_files(d: Path) -> list[Path]:
    """Writers' temp files (not the short-lived writability probe)."""
    return [p for p in d.glob(".tmp-*") if not p.name.startswith(".tmp-probe-")]


def keys_of(report: dict) -> list[str]:
    return [e["key"] for e in report["executables"]]


def test_second_process_loads_from_disk(tmp_path):
    """Two separately started interpreters (no zygote): the second compiles nothing."""
    d = tmp_path / "cache"
    first = spawn_model(d, "--batch", "4")
    assert first["stats"]["xla_compiles"] > 0
    assert first["stats"]["cache_hits_disk"] == 0
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, "the cache folder is created private to the user"
    assert set(entries(d)) == set(keys_of(first))

    second = spawn_model(d, "--batch", "4")
    assert second["stats"]["xla_compiles"] == 0
    assert second["stats"]["cache_hits_disk"] > 0
    assert keys_of(second) == keys_of(first)
    assert _native.cache_verify(str(d)) == (len(entries(d)), [])


def test_xla_flags_are_part_of_the_key(tmp_path):
    """XLA reads XLA_FLAGS once per process and they change the code it emits: a process with
    other flags compiles afresh instead of loading the other flags' executables."""
    d = tmp_path / "cache"
    plain = spawn_model(d, "--batch", "4")
    flagged = spawn_model(d, "--batch", "4", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert flagged["stats"]["xla_compiles"] > 0
    assert flagged["stats"]["cache_hits_disk"] == 0
    assert not set(keys_of(flagged)) & set(keys_of(plain))
    again = spawn_model(d, "--batch", "4", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert again["stats"]["xla_compiles"] == 0
    assert keys_of(again) == keys_of(flagged)


_LARGE_TEMPORARIES = """
import json, os, torch, tpuc
torch.manual_seed(0)
x, w = torch.randn(4096, 1024), torch.randn(1024, 1024) / 32
def g(x, w):
    a = x @ w
    b = a.relu() @ w
    return (a * b) @ w
f = torch.compile(g, backend="tpu")
torch.testing.assert_close(f(x, w), g(x, w), rtol=1e-4, atol=1e-4)
s = tpuc.stats()
print(json.dumps({"flags": os.environ.get("XLA_FLAGS"), "xla_compiles": s["xla_compiles"],
                  "cache_hits_disk": s["cache_hits_disk"]}))
"""


def test_executable_with_large_temporaries_is_cached(tmp_path):
    """An executable whose temporaries (two 16 MiB products alive at once) are above a heap's size still goes
    to the disk cache, and tpuc leaves XLA_FLAGS alone. Splitting temporaries into heaps
    (--xla_multiheap_size_constraint_per_heap, which tpuc once set by default) made XLA refuse
    to serialize such executables: with it set, the warning says so."""
    d = tmp_path / "cache"

    def run(**env):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"TPUC_CACHE_DIR": str(d), **env}
        p = subprocess.run(
            [sys.executable, "-c", _LARGE_TEMPORARIES], env=env, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr

    first, err = run()
    assert first["flags"] is None
    assert (first["xla_compiles"], first["cache_hits_disk"]) == (1, 0)
    assert "could not write cache entry" not in err, err[-2000:]
    assert len(entries(d)) == 1
    second, _ = run()
    assert (second["xla_compiles"], second["cache_hits_disk"]) == (0, 1)

    split, err = run(XLA_FLAGS="--xla_multiheap_size_constraint_per_heap=31457280")
    assert split["xla_compiles"] == 1
    assert "could not write cache entry" in err and "remove the flag to cache it" in err, err[-2000:]


def test_sixteen_concurrent_processes(tmp_path, zygote):
    """16 processes at once into one folder: 8 race on one key (mlp, batch 4), 8 write one key
    each (batches 5..12)."""
    d = tmp_path / "cache"
    batches = [4] * 8 + list(range(5, 13))
    children = [zygote.start("model", ["--cache-dir", d, "--batch", b]) for b in batches]
    assert len({c.pid for c in children}) == 16
    keys = {b: set() for b in batches}
    compiled_same_key = 0
    for b, child in zip(batches, children, strict=True):
        r = child.report()
        assert r["stats"]["xla_compiles"] + r["stats"]["cache_hits_disk"] == 1, r["stats"]
        keys[b].update(keys_of(r))
        compiled_same_key += b == 4 and r["stats"]["xla_compiles"] == 1
    assert all(len(k) == 1 for k in keys.values()), "one key per shape, the same in every process"
    assert compiled_same_key >= 1
    expected = set().union(*keys.values())
    assert len(expected) == 9
    good, bad = _native.cache_verify(str(d))
    assert bad == []
    assert good == 9
    assert set(entries(d)) == expected
    assert temp_files(d) == [], "no temp file is left behind by writers that finished"


def test_sigkill_while_writing(tmp_path, zygote):
    d = tmp_path / "cache"
    writer = zygote.start(
        "model", ["--cache-dir", d, "--batch", "4"], TPUC_DEBUG="cache_write_pause_ms=10000"
    )
    try:
        deadline = time.monotonic() + 600
        while not (d.exists() and temp_files(d)):
            code = writer.poll()
            assert code is None, f"the writer exited ({code}) before writing:\n{writer.output()[1][-3000:]}"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
    finally:
        writer.kill()
    assert writer.wait() == -signal.SIGKILL
    (orphan,) = temp_files(d)
    assert entries(d) == {}, "a killed writer leaves no entry, only its temp file"
    assert orphan.stat().st_size >= HEADER_LEN, "the writer died after header + metadata"

    again = zygote.model(d, "--batch", "4")
    assert again["stats"]["xla_compiles"] > 0
    assert again["stats"]["cache_hits_disk"] == 0
    (key,) = keys_of(again)
    assert key in orphan.name, "the killed writer was writing this very key"
    assert list(entries(d)) == [key]
    assert _native.cache_verify(str(d)) == (1, [])

    # gc neither counts nor evicts the temp orphan as an entry (it is fresh: a writer may be alive).
    code, out, err = zygote.cli("cache", "gc", "--max-size", "1M", "--cache-dir", d)
    assert code == 0, err
    assert "removed 0 entries" in out and "kept 1 " in out, out
    assert "removed 0 stale temp files" in out, out
    assert orphan.exists() and list(entries(d)) == [key]
    # Once old enough to belong to a dead writer, gc removes it (and still keeps the entry).
    old = time.time() - 2 * 3600
    os.utime(orphan, (old, old))
    r = _native.cache_gc(str(d), 1 << 20)
    assert (r["stale_temp_files"], r["kept"], r["removed"]) == (1, 1, 0)
    assert not orphan.exists() and list(entries(d)) == [key]


def _forge_foreign_plugin(path: Path) -> None:
    """Rewrites an entry as if another PJRT plugin build had made it: the metadata's
    plugin_identity (bincode writes the [u8; 32] raw at the start of the metadata) changes, and the
    header checksum blake3(key || meta_len u64 LE || meta || payload) is recomputed, so the file
    is a well-formed entry that only the loader's metadata check can refuse."""
    b = path.read_bytes()
    key = b[12:44]
    meta_len, payload_len = struct.unpack("<QQ", b[44:60])
    meta, payload = b[HEADER_LEN : HEADER_LEN + meta_len], b[HEADER_LEN + meta_len :]
    assert len(payload) == payload_len
    assert blake3(key + struct.pack("<Q", meta_len) + meta + payload) == b[60:92], (
        "the test's blake3 must reproduce the checksum tpuc wrote"
    )
    meta = bytes(x ^ 0xFF for x in meta[:32]) + meta[32:]
    checksum = blake3(key + struct.pack("<Q", meta_len) + meta + payload)
    path.write_bytes(b[:60] + checksum + meta + payload)


def test_blake3_reference():
    for data, digest in VECTORS.items():
        assert blake3(data).hex() == digest


def test_truncated_garbage_and_foreign_plugin_entries(tmp_path, zygote):
    d = tmp_path / "cache"
    sizes = ("--sizes", "2,3,4")
    first = zygote.model(d, *sizes)
    keys = keys_of(first)
    assert len(set(keys)) == 3 and set(entries(d)) == set(keys)
    truncated, garbage, foreign = (d / f"{k}.tpuc" for k in keys)

    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    garbage.write_bytes(random.Random(0).randbytes(garbage.stat().st_size))
    _forge_foreign_plugin(foreign)
    # The forged entry passes the file-level checks (magic, key, lengths, checksum).
    assert _native.cache_info(str(d), keys[2])["key"] == keys[2]

    second = zygote.model(d, *sizes)
    assert keys_of(second) == keys
    assert second["stats"]["cache_hits_disk"] == 0
    assert second["stats"]["xla_compiles"] == 3
    lines = second["stderr"].splitlines()

    def warning(path: Path) -> str:
        """The warning line naming `path`, without the path (tmp_path holds the test's name)."""
        found = [line.replace(str(path), "PATH") for line in lines if str(path) in line]
        assert found, f"no warning names {path}:\n{second['stderr']}"
        return found[0]

    assert "corrupt" in warning(truncated) and "length mismatch" in warning(truncated)
    assert "corrupt" in warning(garbage) and "bad magic" in warning(garbage)
    assert "rejected" in warning(foreign) and "another PJRT plugin" in warning(foreign)
    assert _native.cache_verify(str(d)) == (3, []), "every entry is good again after recompiling"


def test_eviction_under_cap_with_orphan_files(tmp_path, zygote):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    orphan = d / "orphan.bin"
    orphan.write_bytes(os.urandom(1 << 20))  # far above the cap: must not count
    lookalike = d / "notes.tpuc"  # named like an entry, but not a key
    lookalike.write_bytes(b"not an entry")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (orphan, lookalike)}
    # Room for two mlp entries, not three: an entry's size depends on the plugin (about 7 KB on
    # xla-cpu-pjrt, 9 KB on lammps-jax-pjrt-cpu), so it is measured first.
    probe = tmp_path / "probe"
    zygote.model(probe, "--sizes", "2")
    (size,) = entries(probe).values()
    cap = size * 5 // 2

    report = zygote.model(d, "--sizes", "2,3,4,5", TPUC_CACHE_MAX_SIZE=str(cap))
    keys = keys_of(report)
    assert len(set(keys)) == 4 and report["stats"]["xla_compiles"] == 4
    kept = entries(d)
    assert all(cap // 3 < s <= cap // 2 for s in kept.values()), f"entry sizes changed: {kept}"
    assert sum(kept.values()) <= cap
    assert set(kept) == set(keys[-2:]), "the two most recently written entries are kept (LRU)"
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (orphan, lookalike)} == before
    assert _native.cache_verify(str(d)) == (2, [])


def _cannot_switch_user() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CI runs as root) to run a process as user nobody"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to run a process as user nobody"
    return None


# User nobody, keeping one capability: CAP_DAC_READ_SEARCH (read any file), because the venv's
# interpreter lives under /root (mode 0700). It grants no write access anywhere.
AS_NOBODY = (
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=-all,+dac_read_search",
    "--ambient-caps=-all,+dac_read_search",
)


@pytest.mark.skipif(_cannot_switch_user() is not None, reason=_cannot_switch_user() or "")
def test_read_only_cache_folder(tmp_path, zygote):
    """A cache filled by root (folder 0755, entries 0644), used by a user who cannot write it:
    works, reads the entry, compiles the new shape in memory, warns, writes nothing."""
    d = tmp_path / "cache"
    first = zygote.model(d, "--sizes", "2")
    (key,) = keys_of(first)
    d.chmod(0o755)
    for p in d.iterdir():
        p.chmod(0o644)
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)

    ro = spawn_model(d, "--sizes", "2,3", prefix=AS_NOBODY, HOME=str(home))
    assert ro["uid"] == 65534
    assert ro["stats"]["cache_hits_disk"] == 1, "the existing entry is read"
    assert ro["stats"]["xla_compiles"] == 1, "the new shape is compiled (in memory)"
    assert keys_of(ro)[0] == key
    warned = [line for line in ro["stderr"].splitlines() if str(d) in line]
    assert any("read-only" in line.replace(str(d), "PATH") for line in warned), ro["stderr"]
    assert list(entries(d)) == [key], "nothing was written"
    assert temp_files(d) == []
    assert d.stat().st_uid == 0


def test_folder_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError, match=str(d)):
        _native.cache_list(str(d))
    assert cli.main(["cache", "ls", "--cache-dir", str(d)]) == 1


def test_torch_compile_refuses_folder_writable_by_others(tmp_path):
    """The refusal keeps its type through Dynamo, like tpuc's other errors."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    model, (x,) = make("mlp", batch=29, seed=11)  # a shape no other test has in memory
    compiled = torch.compile(model, backend="tpu", options={"cache_dir": str(d)})
    with pytest.raises(PermissionError, match="writable by other users") as info:
        with torch.no_grad():
            compiled(x)
    assert str(d) in str(info.value)
    assert entries(d) == {}


def test_cli_precompile_then_dynamic_process_and_cache_commands(tmp_path, zygote, capsys):
    d = tmp_path / "cache"
    code, out, err = zygote.cli(
        "precompile", "cache_helpers.factories:mlp", "--cache-dir", d, "--buckets", "8,16", cwd=TESTS
    )
    assert code == 0, err
    report = json.loads(out)
    assert (report["executables"], report["compiled"], report["from_cache"]) == (2, 2, 0), report

    # A later process, same model and options, the same dim marked dynamic: nothing to compile,
    # for the bucket sizes and for every size within the buckets.
    later = zygote.model(d, "--sizes", "8,16,5,11", "--dynamic-max", "16")
    assert later["ok"], later["errors"]
    assert later["stats"]["xla_compiles"] == 0
    assert later["stats"]["cache_hits_disk"] == 2

    # The installed `tpuc` command itself, in a fresh interpreter.
    keys = entries(d)
    ls = subprocess.run(
        [str(TPUC_CLI), "cache", "ls", "--cache-dir", str(d)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert ls.returncode == 0, ls.stderr
    assert all(k in ls.stdout for k in keys)
    assert f"{len(keys)} entries" in ls.stdout.splitlines()[-1]

    # The other commands through tpuc.cli.main in this process.
    capsys.readouterr()
    key = min(keys)
    assert cli.main(["cache", "info", key, "--cache-dir", str(d)]) == 0
    info = capsys.readouterr().out
    assert f"key: {key}" in info and f"path: {d / key}.tpuc" in info and "payload_bytes: " in info

    assert cli.main(["cache", "verify", "--cache-dir", str(d)]) == 0
    assert f"{len(keys)} good, 0 bad" in capsys.readouterr().out
    broken = d / f"{key}.tpuc"
    broken.write_bytes(broken.read_bytes()[:-1])
    assert cli.main(["cache", "verify", "--cache-dir", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"removed {broken}" in out and f"{len(keys) - 1} good, 1 bad" in out
    assert not broken.exists()

    keys = entries(d)
    assert cli.main(["cache", "gc", "--max-size", str(max(keys.values())), "--cache-dir", str(d)]) == 0
    assert f"removed {len(keys) - 1} entries" in capsys.readouterr().out
    assert len(entries(d)) == 1

    assert cli.main(["cache", "clear", "--cache-dir", str(d)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert entries(d) == {} and d.is_dir()
    assert tpuc.stats()["xla_compiles"] == 0, "the CLI commands compiled nothing in this process"


def test_precompile_compiles_buckets_in_worker_processes(tmp_path, zygote, monkeypatch):
    """With TPUC_COMPILE_PROCESSES=2 the buckets are compiled by two worker processes (the CPU
    plugin compiles one program at a time per process) into the cache; this process and a later
    one load them all."""
    d = tmp_path / "cache"
    monkeypatch.setenv("TPUC_COMPILE_PROCESSES", "2")
    model, (x,) = make("mlp", batch=4, seed=0)
    report = tpuc.precompile(
        model,
        (x,),
        dynamic={0: {0: 16}},
        buckets=[2, 4, 8, 16],  # pow2, as the later process (the default)
        options={"cache_dir": str(d), "fallback": "error"},
    )
    assert report["processes"] == 2
    assert (report["executables"], report["compiled"], report["from_cache"]) == (4, 4, 0), report
    assert len(entries(d)) == 4
    later = zygote.model(d, "--sizes", "2,4,8,16,3,9", "--dynamic-max", "16")
    assert later["ok"], later["errors"]
    assert later["stats"]["xla_compiles"] == 0
    assert later["stats"]["cache_hits_disk"] == 4, (later["stats"], later.get("executables"))


def test_ir_graph_pickles_exactly():
    """Compile workers receive IR graphs pickled (CBOR inside): every literal survives, NaN and
    infinities included."""
    import pickle

    from torch.fx.experimental.proxy_tensor import make_fx

    from tpuc import fx_export

    def f(x):
        return torch.clamp(x * float("inf"), max=float("nan")) + torch.nan_to_num(x, neginf=-2.5)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3))
    graph = fx_export.export(gm)[0]
    text = str(graph)
    assert "inf" in text and "nan" in text.lower() and "-2.5" in text
    copy = pickle.loads(pickle.dumps(graph))
    assert str(copy) == text
    with pytest.raises(_native.GraphImportError, match="not a tpuc IR graph"):
        _native.FxGraph.from_ir_bytes(b"garbage")


def test_precompile_falls_back_to_this_process_when_workers_fail(tmp_path, monkeypatch, caplog):
    from tpuc import compile_workers

    monkeypatch.setenv("TPUC_COMPILE_PROCESSES", "2")
    monkeypatch.setattr(compile_workers.sys, "executable", "/bin/false")  # every worker exits 1
    model, (x,) = make("mlp", batch=4, seed=0)
    with caplog.at_level("WARNING", logger="tpuc"):
        # Buckets no other test compiles (an MLP bucket module equals the static module of that
        # batch, and tests/test_models.py compiles batches 1 and 3): none in the memory cache.
        report = tpuc.precompile(
            model,
            (x,),
            dynamic={0: {0: 15}},
            buckets=[5, 7, 11, 15],
            options={"cache_dir": str(tmp_path / "c")},
        )
    assert report["processes"] == 1
    assert (report["executables"], report["compiled"]) == (4, 4), (report, tpuc.stats())
    assert "compile workers failed" in caplog.text and "exited with status 1" in caplog.text


def test_an_executable_compiled_in_memory_is_written_to_a_disk_cache_asked_for_later(tmp_path):
    """A graph compiled without a disk cache, then compiled again with one (a saved model, a
    precompile into a deployment folder): the second compile is a memory hit, and the folder
    still gets the executable, so that the process that reads it compiles nothing."""

    def f(x):
        return torch.tanh(x) * 3 - x

    x = torch.randn(7, 5)
    torch._dynamo.reset()
    torch.compile(f, backend="tpu", options={"cache_dir": None})(x)
    torch._dynamo.reset()
    d = tmp_path / "cache"
    before = tpuc.stats()
    out = torch.compile(f, backend="tpu", options={"cache_dir": str(d)})(x)
    after = tpuc.stats()
    torch.testing.assert_close(out, f(x))
    assert after["cache_hits_memory"] == before["cache_hits_memory"] + 1
    assert after["xla_compiles"] == before["xla_compiles"]
    assert len(entries(d)) == 1
