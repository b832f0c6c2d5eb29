"""`tpuc.stats()["graph_compile_seconds"]`: lowering and XLA compile seconds per compiled graph."""

from __future__ import annotations

import torch

import tpuc


def test_compile_seconds_are_recorded_per_graph():
    torch._dynamo.reset()
    tpuc.reset_stats()
    f = torch.compile(lambda x: torch.sin(x) * 3 + 1, backend="tpu", options={"cache_dir": None})
    x = torch.randn(37)
    f(x)
    f(torch.randn(41))  # a second static shape of the same graph (or a dynamic one)
    per_graph = tpuc.stats()["graph_compile_seconds"]
    assert per_graph, "no graph recorded"
    total = tpuc.stats()
    assert sum(g["xla_compiles"] for g in per_graph.values()) == total["xla_compiles"]
    assert abs(sum(g["compile_seconds"] for g in per_graph.values()) - total["compile_seconds"]) < 1e-9
    for name, g in per_graph.items():
        assert isinstance(name, str) and g["lower_seconds"] > 0
        assert g["xla_compiles"] == 0 or g["compile_seconds"] > 0
    tpuc.reset_stats()
    assert tpuc.stats()["graph_compile_seconds"] == {}
