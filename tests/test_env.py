"""tpuc's two switch variables (docs/api.md, "Environment variables") go through one parser, in
Rust (runtime/src/env.rs), which Python reads through `tpuc.env`: the host paths of
TPUC_HOST_KERNELS and the debugging hooks of TPUC_DEBUG, a malformed value an error naming what
is accepted. A retired variable that is set warns once, naming what replaced it."""

from __future__ import annotations

import warnings

import pytest

from tpuc import _native, env, handoff, torch_kernels

PATHS = ["gemm", "conv", "rows", "torch", "handoff", "channels_last", "malloc"]


def test_host_kernels_default_is_every_path(monkeypatch):
    monkeypatch.delenv(env.HOST_KERNELS, raising=False)
    assert env.host_kernel_names() == PATHS
    assert env.host_kernels() == dict.fromkeys(PATHS, True)
    monkeypatch.setenv(env.HOST_KERNELS, "  ")
    assert env.host_kernels() == dict.fromkeys(PATHS, True)


@pytest.mark.parametrize(
    "value, on",
    [
        ("auto", PATHS),
        (" AUTO ", PATHS),
        ("off", []),
        ("gemm,conv", ["gemm", "conv"]),
        ("Rows, ", ["rows"]),
        ("-rows, -TORCH", ["gemm", "conv", "handoff", "channels_last", "malloc"]),
        ("-malloc,-malloc", PATHS[:-1]),
    ],
)
def test_host_kernels_values(value, on):
    assert env.host_kernels(value) == {p: p in on for p in PATHS}


@pytest.mark.parametrize(
    "value, says",
    [
        ("gemm,-conv", "not both"),
        ("blas", 'unknown host path "blas"'),
        ("-blas", 'unknown host path "blas"'),
        ("1", 'unknown host path "1"'),
        ("on", 'unknown host path "on"'),
    ],
)
def test_host_kernels_errors_name_the_accepted_values(value, says):
    with pytest.raises(ValueError, match="TPUC_HOST_KERNELS") as e:
        env.host_kernels(value)
    assert says in str(e.value)
    assert '"auto"' in str(e.value) and '"off"' in str(e.value)
    assert ", ".join(PATHS) in str(e.value)


def test_switches_read_from_python_follow_the_variable(monkeypatch):
    for value, want in [("-torch,-handoff", False), ("auto", True), ("torch,handoff", True), ("gemm", False)]:
        monkeypatch.setenv(env.HOST_KERNELS, value)
        assert torch_kernels.enabled() is want, value
        assert handoff.enabled() is want, value
    monkeypatch.setenv(env.HOST_KERNELS, "torhc")
    with pytest.raises(ValueError, match="torhc"):
        torch_kernels.enabled()


def test_debug_keys_and_values():
    assert set(env.debug_keys()) == {
        "discrete_device",
        "no_host_views",
        "module_format",
        "skip_device_check",
        "profile_every",
        "serial",
        "cache_write_pause_ms",
    }
    value = "discrete_device, module_format=TEXT,profile_every=50,no_host_views=off"
    assert _native.debug_settings(value) == {
        "discrete_device": True,
        "module_format": "text",
        "profile_every": 50,
        "no_host_views": False,
    }
    assert env.debug("discrete_device", value) is True
    assert env.debug("skip_device_check", value) is False  # a flag not given: off
    assert env.debug("cache_write_pause_ms", value) is None
    assert env.debug("discrete_device", "discrete_device,discrete_device=0") is False  # later wins
    with pytest.raises(KeyError):
        env.debug("discrete")


@pytest.mark.parametrize("word", ["1", "on", "ON", "True", " yes ", "Yes", "0", "off", "FALSE", "no"])
def test_debug_flags_take_the_on_off_words(word):
    on, off = _native.flag_words()
    assert (on, off) == (["1", "on", "true", "yes"], ["0", "off", "false", "no"])
    assert env.debug("no_host_views", f"no_host_views={word}") is (word.strip().lower() in on)


@pytest.mark.parametrize(
    "value, says",
    [
        ("discrete", 'unknown key "discrete"; known keys: discrete_device, no_host_views'),
        ("module_format=mlir", "module_format= one of text, bytecode"),
        ("profile_every=-1", "profile_every=N, a non-negative integer"),
        ("skip_device_check=maybe", "skip_device_check alone, or skip_device_check= one of"),
    ],
)
def test_debug_errors_name_the_known_keys_or_values(value, says, monkeypatch):
    with pytest.raises(ValueError, match="TPUC_DEBUG") as e:
        _native.debug_settings(value)
    assert says in str(e.value)
    monkeypatch.setenv(env.DEBUG, value)
    with pytest.raises(ValueError, match="TPUC_DEBUG"):
        env.check()


def test_a_retired_variable_that_is_set_warns_once_naming_its_replacement(monkeypatch):
    for old in env.RETIRED:
        monkeypatch.delenv("TPUC_" + old, raising=False)
    monkeypatch.delenv(env.HOST_KERNELS, raising=False)
    monkeypatch.delenv(env.DEBUG, raising=False)
    monkeypatch.setattr(env, "_warned", False)
    monkeypatch.setenv("TPUC_HOST_GEMM", "0")
    monkeypatch.setenv("TPUC_DISCRETE_DEVICE", "1")
    with pytest.warns(RuntimeWarning, match="no longer read") as caught:
        env.check()
    (w,) = caught
    assert "TPUC_HOST_GEMM (now: TPUC_HOST_KERNELS=-gemm)" in str(w.message)
    assert "TPUC_DISCRETE_DEVICE (now: TPUC_DEBUG=discrete_device)" in str(w.message)
    # Ignored: the path stays on, the hook off.
    assert env.host_kernel("gemm") and not env.debug("discrete_device")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.check()  # once per process


def test_every_replacement_named_is_a_value_the_parser_accepts():
    live = {env.HOST_KERNELS, env.DEBUG}
    for old, new in env.RETIRED.items():
        assert "TPUC_" + old not in live
        first = new.split()[0]
        if first.startswith(env.HOST_KERNELS + "="):
            env.host_kernels(first.split("=", 1)[1])
        elif first.startswith(env.DEBUG + "="):
            assert env.debug(first.split("=")[1], first.split("=", 1)[1].replace("=N", "=1")) is not None
        else:
            assert "constant" in new or "hook" in new or new.startswith("nothing"), (old, new)
