"""Writes into graph inputs kept in the graph (python/tpuc/mutations.py): a static cache's
one-row `index_copy_` written into the cache's own memory, other writes copied back, against
eager PyTorch on the same module."""

import pytest
import torch

import tpuc  # noqa: F401  (registers the backend)
from tpuc import _native, mutations


class Cache(torch.nn.Module):
    """A decode step's side effects: one cache row, a step counter, a running statistic."""

    def __init__(self, cache: torch.Tensor):
        super().__init__()
        self.register_buffer("cache", cache)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x, pos):
        self.cache.index_copy_(2, pos, x)
        self.step += 1
        self.stat.mul_(0.9).add_(x.mean((0, 1, 2)))
        return self.cache.sum(2) * 2, self.step * 1


@pytest.fixture
def row_writes(monkeypatch):
    """How many rows `_native.write_rows` wrote (the real function runs)."""
    seen = []
    real = _native.write_rows

    def counting(rows):
        seen.append(len(rows))
        return real(rows)

    monkeypatch.setattr(mutations._native, "write_rows", counting)
    return seen


def _check(eager: Cache, compiled_module: Cache, fn, steps):
    with torch.no_grad():
        for t in steps:
            x = torch.randn(2, 3, 1, 4)
            pos = torch.tensor([t])
            for a, b in zip(eager(x, pos), fn(x, pos), strict=True):
                torch.testing.assert_close(b, a)
            for name in ("cache", "step", "stat"):
                torch.testing.assert_close(getattr(compiled_module, name), getattr(eager, name))


def test_cache_row_is_written_in_place(row_writes):
    torch.manual_seed(0)
    eager, mine = Cache(torch.zeros(2, 3, 8, 4)), Cache(torch.zeros(2, 3, 8, 4))
    address = mine.cache.data_ptr()
    fn = torch.compile(mine, backend="tpu", options={"cache_dir": None})
    _check(eager, mine, fn, [0, 3, 7, 5, 3])
    assert mine.cache.data_ptr() == address  # the same memory, written in place
    assert sum(row_writes) == 5  # one row per call, by the row path


def test_row_index_out_of_range_raises_and_writes_nothing(row_writes):
    mine = Cache(torch.zeros(2, 3, 8, 4))
    fn = torch.compile(mine, backend="tpu", options={"cache_dir": None})
    with torch.no_grad():
        fn(torch.randn(2, 3, 1, 4), torch.tensor([1]))
        before = {k: v.clone() for k, v in mine.state_dict().items()}
        with pytest.raises(IndexError, match="out of bounds"):
            fn(torch.randn(2, 3, 1, 4), torch.tensor([8]))
    for k, v in mine.state_dict().items():
        torch.testing.assert_close(v, before[k], msg=k)


def test_row_write_bumps_the_version():
    mine = Cache(torch.zeros(2, 3, 8, 4))
    fn = torch.compile(mine, backend="tpu", options={"cache_dir": None})
    with torch.no_grad():
        fn(torch.randn(2, 3, 1, 4), torch.tensor([1]))
        v = mine.cache._version
        fn(torch.randn(2, 3, 1, 4), torch.tensor([2]))
    assert mine.cache._version > v


def test_non_contiguous_cache_is_copied_back(row_writes):
    # A cache held transposed: not the dense row the row path writes, so the whole new value
    # is copied back (as AOTAutograd's wrapper did).
    torch.manual_seed(0)
    eager = Cache(torch.zeros(2, 3, 4, 8).transpose(2, 3))
    mine = Cache(torch.zeros(2, 3, 4, 8).transpose(2, 3))
    fn = torch.compile(mine, backend="tpu", options={"cache_dir": None})
    _check(eager, mine, fn, [0, 6, 2])
    assert not row_writes


@pytest.mark.stand_in
def test_written_input_returned():
    def f(buf, x):
        buf.mul_(2).add_(x)
        return buf, buf.sum()

    fn = torch.compile(f, backend="tpu", options={"cache_dir": None})
    a = torch.randn(5)
    b = a.clone()
    x = torch.randn(5)
    with torch.no_grad():
        for _ in range(3):
            ea, eb = f(a, x)
            ga, gb = fn(b, x)
            torch.testing.assert_close(b, a)
            torch.testing.assert_close(ga, ea)
            torch.testing.assert_close(gb, eb)
            assert ga.data_ptr() == b.data_ptr()  # the input itself, as in eager


@pytest.mark.stand_in
def test_two_writes_into_one_input_and_reads_after(row_writes):
    # Two rows into one cache (not the one-row form: the whole new value is copied back), and
    # the new values read afterwards in the graph.
    def f(cache, a, b, i, j):
        cache.index_copy_(1, i, a)
        cache.index_copy_(1, j, b)
        return cache * 2, cache[:, 0].clone()

    fn = torch.compile(f, backend="tpu", options={"cache_dir": None})
    mine, eager = torch.zeros(3, 6, 4), torch.zeros(3, 6, 4)
    with torch.no_grad():
        for i, j in [(0, 5), (2, 2), (4, 1)]:
            a, b = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
            args = (a, b, torch.tensor([i]), torch.tensor([j]))
            for got, want in zip(fn(mine, *args), f(eager, *args), strict=True):
                torch.testing.assert_close(got, want)
            torch.testing.assert_close(mine, eager)
    assert not row_writes
