"""The preparation pipeline: the FX rewrites every AOTAutograd graph goes through before it is
imported into the Rust IR, declared in one table (`STEPS`, in the order they run), as the IR
passes are in `passes/src/lib.rs`'s `PIPELINE`. Every road runs it (road.py: run here, compile
for a target, its stand-in, precompile, save_compiled): `compile_hook.compile_graph` calls `run`.

A step rewrites the graph and may return a wrapper of the compiled callable: what it took out
of the graph and now does around each call (writes into inputs, views of inputs, checks).
Wrappers nest in the table's order: the first step's is outermost.

Each step is switched by its name in `options["passes"]` (`{"ties": False}`), for debugging:
a step that keeps results right (mutations, input_views, checks, ties) turned off may make a
graph fall back to PyTorch, fail, or differ from eager; a warning says so.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable

import torch
import torch.fx

from . import block_loops, checks, flex, input_views, mutations, regions, ties
from .decompositions import _decompositions
from .options import PREPARE_STEPS
from .storage_ops import _rebase_storage_ops


@dataclasses.dataclass
class Job:
    """One graph on its way through the table: what compile_graph was given, as the steps
    change it (`free_layouts` follows the outputs input_views takes away)."""

    gm: torch.fx.GraphModule
    name: str
    maxima: dict | None
    shard: tuple | None
    free_layouts: tuple | None


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    doc: str
    #: When it applies, in words (docs/architecture.md's table): `applies` decides.
    when: str
    #: Whether results may differ from eager without it (turning it off warns).
    keeps_results: bool
    applies: Callable  # (road, job) -> bool
    run: Callable  # (road, job) -> wrapper (inner -> inner) or None


def _flex(road, job: Job):
    flex.inline_flex_attention(job.gm, _decompositions(bool(job.maxima)))


def _mutations(road, job: Job):
    # Row writes are not combined with bucket padding or a mesh's placed outputs.
    writes = mutations.split(job.gm, rows_allowed=not job.maxima and job.shard is None)
    return None if writes is None else (lambda inner: mutations.WithWrites(inner, writes))


def _input_views(road, job: Job):
    taken = input_views.split(job.gm)
    if not taken:
        return None
    written = mutations.written_inputs(job.gm)
    if written:  # the outputs after those taken out move up
        _, back = input_views.remap_positions(taken, [k for _, k in written])
        new_of = {old: new for new, old in back.items()}
        job.gm.meta[mutations.WRITTEN_INPUTS] = [(i, new_of[k]) for i, k in written if k in new_of]
    if job.free_layouts is not None:
        positions, back = input_views.remap_positions(taken, job.free_layouts[0])
        report = job.free_layouts[1]
        job.free_layouts = (positions, lambda perms: report({back[p]: perm for p, perm in perms.items()}))
    return lambda inner: input_views.WithInputViews(inner, taken)


def _checks(road, job: Job):
    hoisted = checks.hoist(job.gm)
    return (lambda inner: checks.Checked(inner, hoisted)) if hoisted else None


def _storage(road, job: Job):
    _rebase_storage_ops(job.gm)


def _ties(road, job: Job):
    nodes = ties.checked_nodes(job.gm)
    if not nodes:
        return None
    as_is = torch.fx.GraphModule(job.gm, copy.deepcopy(job.gm.graph))  # what PyTorch runs
    n = ties.add_tie_checks(job.gm, nodes)
    name = job.name
    return lambda inner: ties.TieChecked(inner, n, as_is.forward, name)


def _block_loops(road, job: Job):
    return block_loops.loop_chains(job.gm)[1]


def _inline_regions(road, job: Job):
    regions.inline_regions(job.gm)


def _bucketed_or_sharded(job: Job) -> bool:
    return bool(job.maxima) or job.shard is not None


def _always(road, job: Job) -> bool:
    return True


STEPS: tuple[Step, ...] = (
    Step(
        "flex_attention",
        "FlexAttention's higher-order ops replaced by PyTorch's dense math, mods traced in (flex.py)",
        "always",
        True,
        _always,
        _flex,
    ),
    Step(
        "mutations",
        "writes into inputs (copy_ into a placeholder) become outputs, written back after each call (mutations.py)",
        "always (row writes: no buckets, no mesh)",
        True,
        _always,
        _mutations,
    ),
    Step(
        "input_views",
        "outputs that are views of inputs are made from the inputs at call time (input_views.py)",
        "no mesh (a mesh's plan places every output)",
        True,
        lambda road, job: job.shard is None,
        _input_views,
    ),
    Step(
        "checks",
        "runtime checks (linalg errors, _assert_async) become outputs checked on the host (checks.py)",
        "always",
        True,
        _always,
        _checks,
    ),
    Step(
        "storage_rebase",
        "ops that read an input's storage (set_, as_strided) rebased on the input's own layout (storage_ops.py)",
        "always",
        True,
        _always,
        _storage,
    ),
    Step(
        "ties",
        "sort/topk/kthvalue whose order among equal values PyTorch decides get a tie check; a tie reruns in PyTorch (ties.py)",
        "always",
        True,
        _always,
        _ties,
    ),
    Step(
        "block_loops",
        "chains of consecutive calls of one @nested_compile_region block become one scan over stacked operands (block_loops.py)",
        "regions='loop', or 'auto' for a target or on a TPU without declared maxima; no mesh",
        False,
        lambda road, job: (
            job.shard is None and regions.looped(road.opts, road.regions_family, _bucketed_or_sharded(job))
        ),
        _block_loops,
    ),
    Step(
        "inline_regions",
        "calls of @nested_compile_region blocks replaced by the blocks' nodes (regions.py)",
        "regions='inline' or 'loop' (the calls left), or 'auto' on the CPU plugin, for a target or on a TPU (no declared maxima, no mesh)",
        False,
        lambda road, job: regions.inlined(road.opts, road.regions_family, _bucketed_or_sharded(job)),
        _inline_regions,
    ),
)

NAMES = tuple(s.name for s in STEPS)
if NAMES != PREPARE_STEPS:  # the option's vocabulary (options.py) is this table's
    raise ImportError(f"tpuc: prepare.STEPS {NAMES} and options.PREPARE_STEPS {PREPARE_STEPS} differ")


def run(road, job: Job) -> Callable:
    """Runs the table on `job.gm` (in place); returns `wrap(inner)`, the steps' wrappers
    around the compiled callable `inner`."""
    wrappers = []
    for step in STEPS:
        if not step.applies(road, job):
            continue
        if not road.opts.pass_enabled(step.name):
            if step.keeps_results:
                warnings.warn(
                    f"tpuc: preparation step {step.name!r} is off (options['passes']): graph {job.name} "
                    "may fall back to PyTorch, fail or differ from eager",
                    stacklevel=2,
                )
            continue
        w = step.run(road, job)
        if w is not None:
            wrappers.append(w)

    def wrap(inner):
        for w in reversed(wrappers):
            inner = w(inner)
        return inner

    return wrap


def table() -> list[tuple[str, str, str]]:
    """[(name, when, doc)] in order: `tpuc` and the docs show it."""
    return [(s.name, s.when, s.doc) for s in STEPS]
