"""One rule for every on/off environment variable (docs/api.md, "Environment"): Python's
`runtime.env_flag` and Rust's `tpuc_runtime::env::flag` accept the same words."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from tpuc import handoff, runtime, torch_kernels

ROOT = Path(__file__).resolve().parent.parent
NAME = "TPUC_LAYOUT_HANDOFF"  # a real switch, read per compiled graph by handoff.enabled()


@pytest.mark.parametrize("value", ["1", "on", "ON", "True", " yes ", "Yes"])
def test_on_words(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert runtime.env_flag(NAME, False) is True


@pytest.mark.parametrize("value", ["0", "off", "Off", "FALSE", "no\n", " 0"])
def test_off_words(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert runtime.env_flag(NAME, True) is False


@pytest.mark.parametrize("default", [True, False])
def test_unset_and_empty_give_the_default_quietly(monkeypatch, default):
    monkeypatch.delenv(NAME, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.env_flag(NAME, default) is default
        monkeypatch.setenv(NAME, "  ")
        assert runtime.env_flag(NAME, default) is default


@pytest.mark.parametrize("value", ["2", "y", "enabled", "-1"])
def test_other_values_warn_naming_the_variable_and_give_the_default(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    for default in (True, False):
        with pytest.warns(RuntimeWarning, match=rf"{NAME}=.*{re.escape(value)}.*neither on"):
            assert runtime.env_flag(NAME, default) is default


def test_switches_read_from_python_follow_the_rule(monkeypatch):
    # Before one rule: TPUC_TORCH_KERNELS took only "0" as off, so "off" left it on.
    for value, want in [("off", False), ("no", False), ("yes", True), ("1", True)]:
        monkeypatch.setenv("TPUC_TORCH_KERNELS", value)
        monkeypatch.setenv("TPUC_LAYOUT_HANDOFF", value)
        assert torch_kernels.enabled() is want
        assert handoff.enabled() is want


def test_rust_accepts_the_same_words():
    # The Rust side's tables (runtime/src/env.rs); its own unit tests check its parser on them.
    text = (ROOT / "runtime/src/env.rs").read_text()

    def table(name: str) -> tuple[str, ...]:
        m = re.search(rf"pub const {name}: \[&str; \d+\] = \[([^\]]*)\];", text)
        assert m, f"no table {name} in runtime/src/env.rs"
        return tuple(re.findall(r'"([^"]*)"', m.group(1)))

    assert table("ON") == runtime.FLAG_ON
    assert table("OFF") == runtime.FLAG_OFF
