"""Attention over many keys runs through PyTorch's CPU flash attention on the CPU plugin (see
python/tpuc/torch_kernels.py): the graph is split around it, results match eager, nothing is
warned or counted as a fallback; small attention and TPUC_HOST_KERNELS=-torch stay in XLA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import tpuc
from tpuc import env

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"


class Block(torch.nn.Module):
    """Projections before and after the attention, so that it sits inside the graph."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d)) + x


def _run(model, *inputs, **options):
    tpuc.reset_stats()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        compiled = torch.compile(model, backend="tpu", options={"cache_dir": None, **options})
        out = compiled(*inputs)
    return out, tpuc.stats()


@pytest.mark.parametrize("masked", [False, True])
def test_long_attention_runs_in_pytorch_between_compiled_partitions(masked):
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 1100, 32)  # 2 x 4 heads x 1100 x 1100 scores: over 4M
    mask = torch.randn(1100, 1100) if masked else None
    with torch.no_grad():
        out, stats = _run(model, x, mask, fallback="error")
        torch.testing.assert_close(out, model(x, mask), rtol=1e-5, atol=1e-5)
    assert stats["torch_kernels"] == {ATTENTION: 1}
    assert stats["fallback_ops"] == {}
    assert stats["graphs_compiled"] == 2  # the projections before and the ones after


def test_long_attention_in_training_stays_in_xla():
    # With gradients, AOTAutograd decomposes attention into its math (products and softmax):
    # there is no flash attention node to hand over, and both graphs compile whole.
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(1, 1100, 32, requires_grad=True)
    ref = Block()
    ref.load_state_dict(model.state_dict())
    xr = x.detach().clone().requires_grad_()
    out, stats = _run(model, x, fallback="eager")
    out.square().mean().backward()
    ref(xr).square().mean().backward()
    torch.testing.assert_close(out, ref(xr), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)
    assert tpuc.stats()["torch_kernels"] == {} and stats["fallback_ops"] == {}


def test_short_attention_and_the_setting_keep_attention_in_xla(monkeypatch):
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        short = torch.randn(2, 200, 32)
        out, stats = _run(model, short, fallback="error")
        torch.testing.assert_close(out, model(short), rtol=1e-5, atol=1e-5)
        assert stats["torch_kernels"] == {} and stats["graphs_compiled"] == 1

        # What is on now, less `torch` (not conftest's helper: a child process imports this file).
        on = [path for path, is_on in env.host_kernels().items() if is_on and path != "torch"]
        monkeypatch.setenv("TPUC_HOST_KERNELS", ",".join(on) or "off")
        long = torch.randn(2, 1100, 32)
        out, stats = _run(model, long, fallback="error")
        torch.testing.assert_close(out, model(long), rtol=1e-5, atol=1e-5)
        assert stats["torch_kernels"] == {} and stats["graphs_compiled"] == 1


CHILD = r"""
import sys, torch, tpuc
sys.path.insert(0, sys.argv[3])
from test_torch_kernels import Block
torch.manual_seed(0)
model = Block().eval()
x = torch.randn(2, 1100, 32)
with torch.no_grad():
    if sys.argv[1] == "save":
        fn = tpuc.save_compiled(model, sys.argv[2], (x,))
        torch.save(model.state_dict(), sys.argv[2] + ".pt")
    else:
        model.load_state_dict(torch.load(sys.argv[2] + ".pt"))
        fn = tpuc.load_compiled(sys.argv[2], model)
    torch.testing.assert_close(fn(x), model(x), rtol=1e-5, atol=1e-5)
s = tpuc.stats()
print(s["torch_kernels"], s["xla_compiles"])
"""


def test_saved_model_with_long_attention_loads_without_compiling(tmp_path):
    """Saved in one process (its graphs split around the attention), loaded in another: every
    partition's executable comes from the cache."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TPUC_CACHE_DIR=str(tmp_path / "cache"))
    outs = []
    for step in ("save", "load"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, step, str(tmp_path / "block.tpuc"), os.path.dirname(__file__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out.stdout)
    assert ATTENTION in outs[0] and outs[0].split()[-1] == "2"  # the partitions before and after
    assert ATTENTION in outs[1] and outs[1].split()[-1] == "0"  # every executable from the cache
