"""2-D f32 convolutions run in oneDNN (3.x from PyPI's onednn-cpu-gomp, else Debian's libdnnl2
2.x) as XLA FFI custom calls
(`tpuc_conv2d_fwd|bwd_data|bwd_weights`) inside the compiled program, registered with the CPU
plugin at start (`TPUC_HOST_KERNELS=-conv`: never). Checked against eager, forward and both gradients,
over strides, padding, dilation, groups, non-square kernels and batch 1; with the weights changed
under the compiled model in the ways PyTorch allows (in place, `.data =`, `load_state_dict`);
from two threads at once; with oneDNN 2.x where 3.x is the default (a child process: the two
generations make their descriptors through different calls); and with oneDNN off (a child
process), where XLA's lowerings compute the same numbers. Depthwise and 1x1 convolutions, and other dtypes, stay in XLA."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest
import torch

from tpuc import _native, runtime


def _loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _loadable(runtime.host_conv_library()),
    reason="no oneDNN here (PyPI onednn-cpu-gomp or apt libdnnl2; scripts/setup.sh installs both)",
)


def _calls() -> tuple[int, int, int]:
    return _native.Runtime.host_conv_calls()


# (in, out, kernel, stride, padding, dilation, groups, batch, height, width, bias)
CASES = {
    "3x3": (16, 32, 3, 1, 1, 1, 1, 2, 20, 21, True),
    "strided": (16, 24, 3, 2, 1, 1, 1, 2, 19, 18, False),
    "dilated_5x5": (8, 16, 5, 1, 2, 2, 1, 2, 23, 23, True),
    "grouped": (16, 32, 3, 1, 1, 1, 4, 2, 16, 17, True),
    "stem_7x7": (3, 32, 7, 2, 3, 1, 1, 1, 48, 40, False),
    "no_padding_3x5": (12, 20, (3, 5), (1, 2), 0, 1, 1, 3, 15, 22, True),
    "small": (3, 8, 3, 1, 1, 1, 1, 8, 16, 16, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_convolution_and_its_gradients_match_eager(name):
    cin, cout, k, s, p, d, g, n, h, w, bias = CASES[name]
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, bias=bias)
    x = torch.randn(n, cin, h, w)

    def fn(x):
        return torch.relu(conv(x)) * 1.5

    compiled = torch.compile(fn, backend="tpu")
    before = _calls()
    xt = x.clone().requires_grad_()
    out = compiled(xt)
    out.square().sum().backward()
    after = _calls()
    got = (out.detach(), xt.grad, *(p.grad.clone() for p in conv.parameters()))
    conv.zero_grad()
    xe = x.clone().requires_grad_()
    ref = fn(xe)
    ref.square().sum().backward()
    want = (ref.detach(), xe.grad, *(p.grad for p in conv.parameters()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # One forward, one input gradient and one weight gradient ran in oneDNN.
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1], (before, after)


def test_weights_changed_under_the_compiled_model_are_used():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(2, 8, 12, 12)
    compiled = torch.compile(conv, backend="tpu")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), conv(x))
        conv.weight.mul_(-2.0)  # in place
        torch.testing.assert_close(compiled(x), conv(x))
        conv.weight.data = torch.randn_like(conv.weight)  # a new tensor behind the parameter
        torch.testing.assert_close(compiled(x), conv(x))
        state = {k: torch.randn_like(v) for k, v in conv.state_dict().items()}
        conv.load_state_dict(state, assign=True)
        torch.testing.assert_close(compiled(x), conv(x))


def test_two_threads_at_once_each_get_their_own_result():
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    compiled = torch.compile(conv, backend="tpu")
    inputs = [torch.randn(4, 16, 24, 24) for _ in range(2)]
    with torch.no_grad():
        compiled(inputs[0])  # compiled once, before the threads
        want = [conv(x) for x in inputs]
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                for _ in range(20):
                    torch.testing.assert_close(compiled(inputs[i]), want[i])
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def test_depthwise_pointwise_and_float64_convolutions_stay_in_xla():
    torch.manual_seed(3)
    depthwise = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
    pointwise = torch.nn.Conv2d(16, 32, 1)
    double = torch.nn.Conv2d(4, 8, 3, padding=1).double()
    cases = [
        (depthwise, torch.randn(2, 16, 12, 12)),
        (pointwise, torch.randn(2, 16, 12, 12)),
        (double, torch.randn(2, 4, 12, 12, dtype=torch.float64)),
    ]
    before = _calls()
    with torch.no_grad():
        for m, x in cases:
            torch.testing.assert_close(torch.compile(m, backend="tpu")(x), m(x))
    assert _calls() == before


CHILD = r"""
import torch, tpuc
torch.manual_seed(0)
conv = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
x = torch.randn(2, 16, 20, 20, requires_grad=True)
out = torch.compile(lambda x: torch.relu(conv(x)), backend="tpu")(x)
out.sum().backward()
got = (out.detach(), x.grad.clone(), conv.weight.grad.clone())
conv.zero_grad(); x.grad = None
ref = torch.relu(conv(x)); ref.sum().backward()
for a, b in zip(got, (ref.detach(), x.grad, conv.weight.grad)):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
from tpuc import runtime
print("on", runtime.get_runtime(None).host_conv, "calls", sum(tpuc._native.Runtime.host_conv_calls()))
"""


def test_off_keeps_convolutions_in_xla_with_the_same_numbers(tmp_path):
    env = dict(os.environ, TPUC_HOST_KERNELS="-conv", TPUC_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[-4:] == ["on", "False", "calls", "0"], r.stdout


def test_xla_convolution_lowerings_still_match_eager_with_onednn_off(tmp_path):
    # With oneDNN on, 2-D convolutions skip XLA's own lowerings (tap products, NHWC patch
    # products, XLA's convolution): their tests run again in a child with it off.
    tests = [
        "tests/test_ops.py::test_depthwise_convolutions_as_tap_sums",
        "tests/test_ops.py::test_convolutions_with_few_output_positions_as_tap_products",
        "tests/test_ops.py::test_channels_last_convolution_chain_carries_no_transposes",
        "tests/test_ops.py::test_pointwise_and_patch_product_convolutions_forward_and_backward",
        "tests/test_handoff.py",
    ]
    env = dict(os.environ, TPUC_HOST_KERNELS="-conv", TPUC_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.skipif(
    runtime.host_conv_library() == runtime.HOST_CONV_LIBRARY_2 or not _loadable(runtime.HOST_CONV_LIBRARY_2),
    reason="oneDNN 2.x is the default here, or missing",
)
def test_onednn_2_gives_eager_numbers_where_3_is_the_default(tmp_path):
    # oneDNN 2.x makes its descriptors through other calls (op descriptors, format tags numbered
    # differently): the cases above run again in a child that loads it.
    env = dict(os.environ, TPUC_ONEDNN=runtime.HOST_CONV_LIBRARY_2, TPUC_CACHE_DIR=str(tmp_path / "cache"))
    check = (
        "import tpuc, tpuc.runtime as r; r.get_runtime(None); print(tpuc._native.Runtime.host_conv_version())"
    )
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split("\n")[-2].startswith("(2, "), r.stdout + r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_convolution_and_its_gradients_match_eager",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_a_named_onednn_that_cannot_load_is_reported(tmp_path):
    # The default library's absence only means XLA's convolutions; one the user named must say so.
    env = dict(os.environ, TPUC_ONEDNN=str(tmp_path / "libdnnl.so.3"), TPUC_CACHE_DIR=str(tmp_path / "cache"))
    check = (
        "import tpuc, tpuc.runtime as r; r.get_runtime(None); print(tpuc._native.Runtime.host_conv_version())"
    )
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TPUC_ONEDNN=" in r.stderr and "convolutions run in XLA" in r.stderr, r.stderr
    assert r.stdout.split("\n")[-2] == "None", r.stdout
