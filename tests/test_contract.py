"""docs/api.md is the user contract: this holds it and the code together, both ways. Every
option and enumerated value, every TPUC_* variable the non-test sources name (with the host
paths of TPUC_HOST_KERNELS, the keys of TPUC_DEBUG and the retired variables), every
`tpuc.stats()` key, every public name, error type and CLI command or flag is listed there, and
nothing listed there is missing from the code.

docs/api.md is read by its `## ` sections and the first cell of each table row (a backticked
name), so prose can change freely."""

from __future__ import annotations

import builtins
import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

import tpuc
from tpuc import cli, env, options, runtime

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"

# The non-test sources: every crate of the workspace (a top-level folder with a Cargo.toml, so a
# new crate is covered too), the Python package, scripts and examples; and the suffixes of files
# there that are text.
SOURCE_DIRS = tuple(
    sorted({p.parent.name for p in ROOT.glob("*/Cargo.toml")} | {"python", "scripts", "examples"})
)
SOURCE_FILES = ("Makefile",)
TEXT_SUFFIXES = {".py", ".rs", ".sh", ".toml", ".supp"}


def _sections() -> dict[str, str]:
    """docs/api.md by `## ` heading: {heading: text up to the next one (### included)}."""
    out: dict[str, str] = {}
    heading = None
    for line in API.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            out[heading] = ""
        elif heading is not None:
            out[heading] += line + "\n"
    return out


def _rows(section: str) -> dict[str, list[str]]:
    """The table rows of a section by their first cell's backticked name: {name: cells}."""
    text = _sections()[section]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*`([^`]+)`\s*\|", line)
        if m:
            # `\|` inside a cell is a literal bar, not a cell border.
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            assert m.group(1) not in rows, f"docs/api.md {section}: {m.group(1)} listed twice"
            rows[m.group(1)] = cells
    return rows


def _diff(what: str, in_code: set, in_docs: set) -> str:
    return (
        f"{what}: in the code but not in docs/api.md: {sorted(in_code - in_docs)}; "
        f"in docs/api.md but not in the code: {sorted(in_docs - in_code)}"
    )


def _source_files():
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            rel = path.relative_to(ROOT)
            if (
                path.is_file()
                and path.suffix in TEXT_SUFFIXES
                and "tests" not in rel.parts
                and path.name != "tests.rs"
                and "target" not in rel.parts
            ):
                yield path
    for f in SOURCE_FILES:
        yield ROOT / f


def _quoted(cell: str) -> set[str]:
    return set(re.findall(r'`?"([^"`]+)"`?', cell))


def test_sections_parse():
    sections = _sections()
    for name in (
        "Options",
        "Python API",
        "Errors",
        "Statistics",
        "Command line",
        "Environment variables",
        "Host paths",
        "Debugging hooks",
        "Retired variables",
    ):
        assert name in sections, f"docs/api.md has no `## {name}` section"
        assert _rows(name), f"docs/api.md `## {name}` has no table rows"


def test_option_keys():
    in_docs = set(_rows("Options"))
    assert in_docs == set(options.VALID_KEYS), _diff("options", set(options.VALID_KEYS), in_docs)


@pytest.mark.parametrize(
    "key, valid",
    [
        ("precision", options.PRECISIONS),
        ("fallback", options.FALLBACKS),
        ("sharding", options.SHARDINGS),
        ("residency", options.RESIDENCIES),
        ("passes", None),  # the groups and the pipeline's passes (needs the extension)
        ("plugin", None),  # families and wheel names runtime.resolve_plugin knows
    ],
)
def test_option_values(key, valid):
    if key == "passes":
        valid = options.pass_names()
    elif key == "plugin":
        valid = (
            set(runtime._PLUGIN_WHEELS)
            | {dist for wheels in runtime._PLUGIN_WHEELS.values() for dist, _ in wheels}
            | set(runtime._OTHER_CPU_WHEELS)
        )
    values_cell = _rows("Options")[key][1]
    in_docs = _quoted(values_cell)
    assert in_docs == set(valid), _diff(f"values of option {key!r}", set(valid), in_docs)
    for value in valid:
        if key in ("passes", "plugin"):
            continue
        # Every listed value is accepted, and a value not listed is refused.
        options.parse({key: value})
    if key in ("precision", "fallback", "residency"):
        with pytest.raises(ValueError, match=key):
            options.parse({key: "not-a-" + key})


def test_environment_variables():
    in_code = set()
    for path in _source_files():
        in_code |= set(re.findall(r"TPUC_[A-Z0-9_]+", path.read_text(errors="replace")))
    in_docs = {name for name in _rows("Environment variables") if name.startswith("TPUC_")}
    assert in_docs == in_code, _diff("TPUC_* variables", in_code, in_docs)


def test_host_paths():
    # TPUC_HOST_KERNELS's paths, as the one parser (runtime/src/env.rs) names them.
    in_docs = list(_rows("Host paths"))
    assert in_docs == env.host_kernel_names(), _diff("host paths", set(env.host_kernel_names()), set(in_docs))


def test_debugging_hooks():
    rows = _rows("Debugging hooks")
    keys = env.debug_keys()
    assert set(rows) == set(keys), _diff("TPUC_DEBUG keys", set(keys), set(rows))
    for key, (kind, values, _) in keys.items():
        cell = rows[key][1]
        if kind == "flag":
            assert cell == "on/off", f"{key} is a flag; docs/api.md says {cell!r}"
        elif kind == "count":
            assert "integer" in cell, f"{key} takes an integer; docs/api.md says {cell!r}"
        else:
            assert set(re.findall(r"`([^`]+)`", cell)) == set(values), f"{key}: {values} vs {cell!r}"


def test_retired_variables():
    # The variables tpuc no longer reads are listed with what replaced them (tpuc.env.RETIRED,
    # spelled without their prefix), and no non-test source names one.
    rows = _rows("Retired variables")
    retired = {"TPUC_" + old: new for old, new in env.RETIRED.items()}
    assert set(rows) == set(retired), _diff("retired variables", set(retired), set(rows))
    for name, new in retired.items():
        assert rows[name][1].replace("`", "") == new, f"{name}: docs/api.md does not say {new!r}"
    named = set()
    for path in _source_files():
        named |= set(re.findall(r"TPUC_[A-Z0-9_]+", path.read_text(errors="replace"))) & set(retired)
    assert not named, f"retired variables still named in the sources: {sorted(named)}"


def test_stats_keys():
    stats = tpuc.stats()
    rows = _rows("Statistics")
    assert set(rows) == set(stats), _diff("tpuc.stats() keys", set(stats), set(rows))
    for field in ("runs", "ops_before", "ops_after", "ops_removed", "changes", "seconds"):
        assert f'"{field}"' in rows["passes"][1], f"stats()['passes'] field {field} not in docs/api.md"


def test_public_names():
    rows = _rows("Python API")
    assert set(rows) == set(tpuc.__all__), _diff("tpuc.__all__", set(tpuc.__all__), set(rows))
    for name in tpuc.__all__:
        assert getattr(tpuc, name) is not None


def test_error_types():
    rows = _rows("Errors")
    exported = {n for n in tpuc.__all__ if isinstance(getattr(tpuc, n), type)}
    listed = {n for n in rows if hasattr(tpuc, n)}
    assert listed == exported, _diff("error types", exported, listed)
    for name, cells in rows.items():
        cls = getattr(tpuc, name, None) or getattr(builtins, name)
        assert issubclass(cls, BaseException), name
        base = cells[1].strip("`")
        if base:
            base_cls = getattr(tpuc, base, None) or getattr(builtins, base)
            assert cls.__bases__ == (base_cls,), f"{name}'s base is {cls.__bases__}, docs/api.md says {base}"


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(argv + ["--help"])
    return out.getvalue()


def test_cli_commands_and_flags():
    rows = _rows("Command line")
    commands = set(re.search(r"\{([a-z,-]+)\}", _help([])).group(1).split(","))
    assert set(rows) == commands, _diff("CLI commands", commands, set(rows))
    for command in commands:
        text = _help([command])
        flags = set(re.findall(r"(--[a-z][a-z-]*)", text)) - {"--help"}
        choices = set()
        for group in re.findall(r"\{([a-z,]+)\}", text):
            choices |= set(group.split(","))
        row = " | ".join(rows[command][1:])
        documented_flags = set(re.findall(r"(--[a-z][a-z-]*)", row))
        assert documented_flags == flags, _diff(f"flags of `tpuc {command}`", flags, documented_flags)
        for choice in choices:
            assert re.search(rf"\b{choice}\b", row), f"`tpuc {command} {choice}` not in docs/api.md"


def test_no_reference_to_the_old_contract_file():
    # The contract used to live outside the repository as "API" ".md"; it is docs/api.md now.
    old = "API" + ".md"
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    stale = []
    for f in files:
        path = ROOT / f
        if not f or not path.is_file() or path.suffix in {".json", ".png", ".so"}:
            continue
        if old in path.read_text(errors="replace"):
            stale.append(f)
    assert not stale, f"files naming {old} (use docs/api.md): {stale}"
