"""Dynamo never traces tpuc's own code.

Dynamo's frame callback stays installed while a compiled function runs, so every Python frame
that starts under it is offered to Dynamo as a new frame to compile, unless it is wrapped in
`torch._dynamo.disable`. Dynamo wraps what a backend returns (the forward) itself. The backward
is different: AOTAutograd compiles it lazily and runs it from the autograd engine, inside
`loss.backward()`, and when that call sits in a compiled function (a whole training step) the
callback is live. Dynamo then compiled tpuc's runtime as user code: the backward compiler's
frames on the first call, and the call path's (`_host_array` once parameters became resident, a
new shape per parameter, so automatic dynamic made them symbolic and `t.nbytes` raised
TorchRuntimeError). torch's own `aot_autograd` backends (aot_eager, Inductor) wrap their
backward compiler and its result in `disable` (torch/_dynamo/backends/common.py, Note [Wrapping
bw_compiler in disable]); tpuc calls `aot_module_simplified` itself, so it does the same here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler


def runnable(compiled: Callable, what: str) -> Callable:
    """`compiled` (a boxed graph tpuc made) behind `torch._dynamo.disable`: nothing it runs is
    traced. The wrapper keeps the boxed calling convention (`_boxed_call` is a class attribute of
    tpuc's graphs, which functools.wraps does not copy) and, through `__wrapped__`, the object
    AOTAutograd's cache entry stores."""
    wrapped = torch._dynamo.disable(compiled, reason=f"do not trace tpuc's compiled {what}")
    if getattr(compiled, "_boxed_call", False):
        wrapped._boxed_call = True
    return wrapped


def backward_compiler(compiler):
    """AOTAutograd's `bw_compiler` for `compiler` (a function of (graph, example inputs), or a
    SerializableAOTDispatchCompiler around one): compiling and the compiled backward both run
    with Dynamo off."""
    if isinstance(compiler, SerializableAOTDispatchCompiler):
        compiler.compiler_fn = backward_compiler(compiler.compiler_fn)
        return compiler

    def compile_backward(g, example_inputs):
        compiled = torch._dynamo.disable(compiler, reason="do not trace tpuc's backward compiler")(
            g, example_inputs
        )
        return runnable(compiled, "backward")

    return compile_backward
