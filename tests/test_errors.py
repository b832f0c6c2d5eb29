"""Bad input gives a clear Python exception of the documented type, never a process abort."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tpuc


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4)


def test_unknown_option_is_a_value_error_listing_valid_keys():
    model, x = mlp()
    with pytest.raises(ValueError, match="unknown option.*'colour'.*valid keys are: plugin, precision"):
        torch.compile(model, backend="tpu", options={"colour": "blue"})(x)


@pytest.mark.parametrize(
    "key,value",
    [("precision", "fast"), ("fallback", "maybe"), ("buckets", [0, 4]), ("passes", {"nonsense": True})],
)
def test_bad_option_value_is_a_value_error(key, value):
    model, x = mlp()
    with pytest.raises(ValueError, match=f"bad value for option '{key}'"):
        torch.compile(model, backend="tpu", options={key: value})(x)


def test_missing_plugin_path_names_the_path():
    model, x = mlp()
    with pytest.raises(ValueError, match="/no/such/plugin.so.*does not exist"):
        torch.compile(model, backend="tpu", options={"plugin": "/no/such/plugin.so"})(x)


def test_file_that_is_not_a_pjrt_plugin(tmp_path):
    fake = tmp_path / "fake_plugin.so"
    fake.write_bytes(b"\x7fELF this is not a shared library")
    model, x = mlp()
    with pytest.raises(tpuc.PjrtError, match="cannot load PJRT plugin"):
        torch.compile(model, backend="tpu", options={"plugin": str(fake)})(x)


def test_shared_library_without_pjrt_entry_point():
    libm = next(
        p
        for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6")
        if os.path.exists(p)
    )
    model, x = mlp()
    with pytest.raises(tpuc.PjrtError, match="GetPjrtApi"):
        torch.compile(model, backend="tpu", options={"plugin": libm})(x)


@torch.library.custom_op("tpuc_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An op tpuc can never have a lowering rule for: it stands for "any unsupported op"."""
    return x.sin() * 3


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


def unsupported_fn(x):
    return mystery(x) * 2 + 1


def test_unsupported_op_with_fallback_error_names_op_and_node():
    x = torch.randn(5, 3)
    with pytest.raises(
        tpuc.UnsupportedOpError, match=r"unsupported op `tpuc_test\.mystery\.default` \(node `mystery`\)"
    ):
        torch.compile(unsupported_fn, backend="tpu", options={"fallback": "error"})(x)


def test_fallback_error_says_where_the_op_came_from():
    x = torch.randn(5, 3)
    with pytest.raises(tpuc.UnsupportedOpError) as info:
        torch.compile(unsupported_fn, backend="tpu", options={"fallback": "error"})(x)
    message = str(info.value)
    assert "test_errors.py" in message and "mystery(x)" in message, message
    assert info.value.op == "tpuc_test.mystery.default" and info.value.node == "mystery"


def test_unsupported_op_with_fallback_eager_runs_it_in_pytorch_and_says_so():
    x = torch.randn(5, 3)
    with pytest.warns(UserWarning, match="tpuc_test.mystery.default"):
        out = torch.compile(unsupported_fn, backend="tpu")(x)
    torch.testing.assert_close(out, unsupported_fn(x))
    s = tpuc.stats()
    assert s["fallback_ops"] == {"tpuc_test.mystery.default": 1}
    assert s["xla_compiles"] >= 1  # the supported part still ran through tpuc


def test_pjrt_compile_error_carries_the_plugin_message():
    rt = tpuc.runtime.get_runtime(None)
    graph = tpuc._native.FxGraph.from_json(
        '{"nodes": [{"name": "x", "op": "placeholder", "val": {"tensor": {"shape": [2], "dtype": "float32"}}},'
        '{"name": "output", "op": "output", "args": [[{"node": "x"}]]}]}'
    )
    exe = rt.compile(graph, {}, "highest")  # a valid identity graph compiles
    # Its output is its input, handed back as the caller's tensor: no output of the executable.
    assert exe.output_types == [] and exe.output_plan() == [("input", "0")], exe.output_plan()
    with pytest.raises(tpuc.TpucError, match="symbolic size `s9`"):
        g = tpuc._native.FxGraph.from_json(
            '{"nodes": [{"name": "x", "op": "placeholder", "val": {"tensor": {"shape": ["s9"], "dtype": "float32"}}},'
            '{"name": "output", "op": "output", "args": [[{"node": "x"}]]}]}'
        )
        rt.compile(g, {}, "highest")


def test_backend_works_without_importing_tpuc():
    code = textwrap.dedent(
        """
        import sys, torch
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="tpu")
        x = torch.randn(8)
        torch.testing.assert_close(f(x), torch.relu(x) * 2)
        assert "tpuc" in sys.modules  # loaded lazily through the entry point
        f2 = torch.compile(lambda x: x + 1, backend="tpuc")
        torch.testing.assert_close(f2(x), x + 1)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
