"""A whole training step as one Dynamo graph, so one tpuc program (docs/training.md).

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

Stock Dynamo (torch 2.15) cuts that step in three places (four with a learning-rate scheduler),
and tpuc removes each cut, but only while Dynamo traces a frame whose backend is tpuc
(`_tracing_tpuc`): other backends, eager code and PyTorch's config stay as they are.

1. `loss.backward()` breaks the graph unless `torch._dynamo.config.trace_autograd_ops` is on;
   with it on, Dynamo writes the backward into the same graph (autograd.grad plus one
   `accumulate_grad_` per leaf). tpuc turns it on around the trace of its own frames only
   (`InstructionTranslator.run`): the flag is read at trace time, and Dynamo's compiled code is
   guarded on its backend, so a frame traced for another backend never sees it. A frame whose
   inputs carry autograd history keeps the stock graph break (`_backward_within_frame`).
2. `Optimizer.step` calls `torch._dynamo.graph_break()` before and after the update
   (torch/optim/optimizer.py `_use_grad_for_differentiable`, pytorch#104053: it keeps Inductor's
   optimizer graph an inference graph). tpuc ignores exactly those two calls, recognised by the
   code object of that wrapper, in its own frames; the update is an inference graph for
   AOTAutograd either way (no output requires grad), and grad mode is still switched off for it.
3. Dynamo runs the optimizer's `_init_group` eagerly at trace time, reading `p.grad`; a `.grad`
   the traced backward has just set is only pending in the graph, so Dynamo breaks there
   ("optimizer: pending mutation on parameter"). For tpuc's frames, when the only pending writes
   on the parameters are their `.grad`, `_init_group` runs with stand-in tensors of the traced
   gradients' shapes, dtypes and strides in `p.grad`, its guards are taken on the real values
   (restored before), and the gradient lists it fills are mapped back to the traced gradients.
4. A learning-rate scheduler wraps `opt.step` in a function of torch/optim/lr_scheduler.py, a
   file Dynamo skips; in tpuc's frames that wrapper's work is done in the trace instead
   (`_scheduler_wrapped_step`).

5. After a graph break (the `zero_grad` below), Dynamo continues in a generated resume
   function, and skips it unless it "has tensors": a tensor or module among its locals, or a
   `torch` module among the globals it names. A step written at a script's top level whose rest
   names only globals (`loss = model(ids).logits.square().mean()`, with `model`, `opt` and `ids`
   module globals) has neither, so its forward, backward and update ran as three frames (three
   programs). The resume functions Dynamo creates while tracing tpuc's frames are marked to be
   traced always (`_trace_resume_functions`), as a `torch.compile`d function's own code is.

6. `Optimizer.zero_grad` is a skipped function (`torch._disable_dynamo`): Dynamo breaks there
   and runs it eagerly. At the start of a step that costs no program, but at the end (after
   `opt.step()`) the gradients became outputs of the program for the `.grad` that zero_grad then
   clears. In tpuc's frames `zero_grad()` with `set_to_none=True` (its default), after a
   backward() in the same frame, is traced as each parameter's `.grad = None`
   (`_trace_zero_grad_to_none`), so no gradient the user cannot read leaves the program; at
   the start of a step and with `set_to_none=False` the break stays.

Anything else that breaks the graph (a hook, `.item()`, a print) splits the step as before;
`tpuc.stats()["graph_breaks"]` lists the reasons in tpuc's frames.

Adam and AdamW need no `capturable=True`: Dynamo already traces every optimizer as capturable
(the step counter stays a tensor, an input written in place) without changing the user's
param_groups.
"""

from __future__ import annotations

import contextvars
import functools
import logging

import torch

from . import counters

log = logging.getLogger("tpuc")

# While Dynamo traces a frame whose backend is tpuc: the user's own trace_autograd_ops (for
# frames of other backends traced meanwhile); None otherwise.
_users_setting: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "tpuc_users_setting", default=None
)


def _tracing_tpuc() -> bool:
    return _users_setting.get() is not None


_installed = False


def _innermost_backend(fn):
    """The function behind Dynamo's backend wrappers (WrapBackendDebug, torch.compile's
    wrapper, functools.partial)."""
    for _ in range(16):
        nxt = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
        if nxt is None and isinstance(fn, functools.partial):
            nxt = fn.func
        if nxt is None:
            return fn
        fn = nxt
    return fn


def install(backend_fn) -> None:
    """Installs the tracer hooks above (once per process); each acts only in frames Dynamo
    traces for `backend_fn`. On a torch without the internals they hook, nothing is
    installed and steps split as in stock PyTorch."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import Method
        from torch._dynamo.variables.constant import ConstantVariable
        from torch._dynamo.variables.functions import SkipFunctionVariable
        from torch._dynamo.variables.optimizer import OptimizerVariable
        from torch._dynamo.variables.tensor import TensorVariable
        from torch.optim.optimizer import _use_grad_for_differentiable

        if not hasattr(dynamo_config, "trace_autograd_ops"):
            raise AttributeError("torch._dynamo.config.trace_autograd_ops")
        init_group = OptimizerVariable.tp_methods["_init_group"]
        backward = TensorVariable.tp_methods["backward"]
    except (ImportError, AttributeError, KeyError) as e:
        log.warning(
            "tpuc: this torch lacks what whole-step capture hooks (%s); steps split as in stock PyTorch", e
        )
        return

    _hook_translator(InstructionTranslator, dynamo_config, backend_fn)
    _trace_resume_functions()
    _trace_zero_grad_to_none(InstructionTranslator.__mro__[1])
    _hook_graph_break(SkipFunctionVariable, ConstantVariable, _use_grad_for_differentiable)
    OptimizerVariable.tp_methods["_init_group"] = Method(_traced_grads_init_group(init_group.handler))
    TensorVariable.tp_methods["backward"] = Method(_backward_within_frame(backward.handler))


def _hook_translator(translator_cls, dynamo_config, backend_fn) -> None:
    run = translator_cls.run

    def run_for_backend(self):
        ours = _innermost_backend(getattr(self.output, "compiler_fn", None)) is backend_fn
        users = _users_setting.get()
        if not ours and users is None:
            return run(self)
        if not ours:
            # Another backend's frame traced inside one of tpuc's (a nested compile): the user's
            # setting, none of tpuc's hooks.
            token = _users_setting.set(None)
            try:
                with dynamo_config.patch(trace_autograd_ops=users):
                    return run(self)
            finally:
                _users_setting.reset(token)
        breaks = torch._dynamo.utils.counters["graph_break"]
        before = dict(breaks)
        token = _users_setting.set(dynamo_config.trace_autograd_ops if users is None else users)
        try:
            with dynamo_config.patch(trace_autograd_ops=True):
                return run(self)
        finally:
            _users_setting.reset(token)
            for reason, n in breaks.items():
                if n > before.get(reason, 0):
                    counters.count_graph_break(_short(reason), n - before.get(reason, 0))

    translator_cls.run = run_for_backend


def _short(reason: str) -> str:
    """Dynamo's graph-break message as one line: its type and explanation."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    why = next((line[len("Explanation:") :].strip() for line in lines if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {why}" if lines and why else (lines[0] if lines else reason)


def _trace_resume_functions() -> None:
    """Marks the resume functions Dynamo generates while tracing a frame for tpuc as code to
    trace always (item 5 of the module docs); other backends' resume functions are untouched."""
    try:
        from torch._dynamo.eval_frame import always_optimize_code_objects
        from torch._dynamo.resume_execution import ContinueExecutionCache
    except ImportError as e:
        log.warning("tpuc: this torch lacks Dynamo's resume-function cache (%s); a step may split", e)
        return
    lookup = ContinueExecutionCache.lookup.__func__

    def lookup_for_backend(cls, *args, **kwargs):
        code = lookup(cls, *args, **kwargs)
        if _tracing_tpuc():
            always_optimize_code_objects[code] = True
        return code

    ContinueExecutionCache.lookup = classmethod(lookup_for_backend)


def _trace_zero_grad_to_none(translator_base_cls) -> None:
    """`opt.zero_grad()` / `opt.zero_grad(set_to_none=True)` (item 6 of the module docs):
    Optimizer.zero_grad is wrapped in `torch._disable_dynamo`, so Dynamo breaks the graph there
    and runs it eagerly. At the end of a step that break made the gradients outputs of the
    program (Dynamo sets `p.grad` before zero_grad clears it) and split off a frame for what
    followed. In tpuc's frames the call is traced as what it does with `set_to_none`: each
    parameter's `.grad = None` (`_grads_to_none`), where a backward() in this frame has set
    the gradients it clears (the end of a step). At the start of a step, in subclasses that
    override zero_grad and with `set_to_none=False`, the break stays (the traced backward would
    accumulate into the real `.grad` the traced clear does not reach)."""
    zero_grad = getattr(torch.optim.Optimizer.zero_grad, "__wrapped__", None)
    inline = getattr(translator_base_cls, "inline_user_function_return", None)
    if zero_grad is None or inline is None:
        log.warning("tpuc: this torch's Optimizer.zero_grad is not the one tpuc traces; it splits a step")
        return

    def inline_for_backend(self, fn, args, kwargs, **more):
        if (
            _tracing_tpuc()
            and args
            and _is_zero_grad_to_none(fn, zero_grad, args, kwargs)
            and _pending_grads(args[0], self)
        ):
            from torch._dynamo.variables.base import VariableTracker

            # A backward() later in this frame would accumulate into the cleared gradients:
            # `_backward_within_frame` breaks the graph there instead.
            self.output.tpuc_grads_cleared = True
            return inline(self, VariableTracker.build(self, _grads_to_none), [args[0]], {}, **more)
        return inline(self, fn, args, kwargs, **more)

    translator_base_cls.inline_user_function_return = inline_for_backend


def _is_zero_grad_to_none(fn_vt, zero_grad, args, kwargs) -> bool:
    """Whether `fn_vt(*args, **kwargs)` is torch's own Optimizer.zero_grad with set_to_none
    true (its default), on an optimizer whose class does not override it."""
    from torch._dynamo.variables.constant import ConstantVariable

    try:
        f = fn_vt.get_function()
    except Exception:  # not a function variable
        return False
    if getattr(f, "__wrapped__", None) is not zero_grad:
        return False
    if len(args) > 2 or set(kwargs) - {"set_to_none"}:
        return False
    flag = args[1] if len(args) == 2 else kwargs.get("set_to_none")
    if flag is None:
        return True
    return isinstance(flag, ConstantVariable) and flag.value is True


def _grads_to_none(opt) -> None:
    """What Optimizer.zero_grad(set_to_none=True) does to the gradients (traced by Dynamo)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def _hook_graph_break(skip_fn_cls, constant_cls, use_grad_for_differentiable) -> None:
    # The code object of the optimizer step's wrapper (the same for every decorated step).
    wrapper_code = use_grad_for_differentiable(lambda self: None).__code__
    call_function = skip_fn_cls.call_function

    def call_function_for_backend(self, tx, args, kwargs):
        if self.value is torch._dynamo.graph_break and _tracing_tpuc() and tx.f_code is wrapper_code:
            return constant_cls.create(None)
        if _tracing_tpuc() and getattr(self.value, "_wrapped_by_lr_sched", False):
            stepped = _scheduler_wrapped_step(self, tx, args, kwargs)
            if stepped is not None:
                return stepped
        return call_function(self, tx, args, kwargs)

    skip_fn_cls.call_function = call_function_for_backend


def _scheduler_wrapped_step(fn_vt, tx, args, kwargs):
    """`opt.step(...)` where a learning-rate scheduler wrapped it (torch/optim/lr_scheduler.py,
    a file Dynamo skips): the wrapper only flags the optimizer as stepped (`_opt_called`, read
    by the scheduler's warning, never reset) and calls the class's step, so the flag is set here
    and the class's step traced in place of the skipped call. None where the wrapper is not
    that one (its closure: a weak reference to the optimizer and the step function)."""
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.builder import VariableBuilder

    wrapper, source = fn_vt.value, fn_vt.source
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True))
    if set(cells) != {"opt_ref", "func"} or not isinstance(source, AttrSource) or source.member != "step":
        return None
    opt, func = cells["opt_ref"].cell_contents(), cells["func"].cell_contents
    if not isinstance(opt, torch.optim.Optimizer) or not callable(func):
        return None
    opt._opt_called = True
    opt_vt = VariableBuilder(tx, source.base)(opt)
    return tx.inline_user_function_return(VariableTracker.build(tx, func), [opt_vt, *args], kwargs)


def _backward_within_frame(handler):
    """TensorVariable's `backward` handler, traced only when the frame's autograd graph is all
    its own. Dynamo's traced `backward()` finds the leaves to accumulate into among the frame's
    inputs and the tensors it created, and does nothing when it finds none: after a graph break
    between the forward and `loss.backward()` (a `.item()`, a print), `loss` arrives as an input
    whose history lies in the graph before, and the step silently lost its gradients (checked
    with torch 2.15 and aot_eager too). When any input of the frame carries autograd history
    (`grad_fn`), the call graph-breaks and the autograd engine runs it, as in stock PyTorch."""

    def backward(self, tx, *args, **kwargs):  # TensorVariable's handlers take unpacked arguments
        if _tracing_tpuc() and getattr(tx.output, "tpuc_grads_cleared", False):
            from torch._dynamo.exc import unimplemented

            unimplemented(
                gb_type="tpuc: backward() after a traced zero_grad()",
                context=f"call_method {self} backward",
                explanation="zero_grad() cleared gradients earlier in this graph; this backward runs "
                "after the graph, through the autograd engine.",
                hints=[],
            )
        if _tracing_tpuc() and _inputs_with_history(tx):
            from torch._dynamo.exc import unimplemented

            unimplemented(
                gb_type="tpuc: backward() over autograd history from before this graph",
                context=f"call_method {self} backward",
                explanation="An input of this frame carries autograd history (a graph break between "
                "the forward and backward()): the autograd engine runs this backward.",
                hints=["Keep the forward and backward() in one graph (no .item(), print or hook between)."],
            )
        return handler(self, tx, *args, **kwargs)

    return backward


def _inputs_with_history(tx) -> bool:
    from torch._dynamo.variables.tensor import TensorVariable

    for var in tx.output.input_source_to_var.values():
        if not isinstance(var, TensorVariable):
            continue
        t = var.as_proxy().node.meta.get("example_value")
        if isinstance(t, torch.Tensor) and (
            t.grad_fn is not None or (t._base is not None and t._base.grad_fn is not None)
        ):
            return True
    return False


def _traced_grads_init_group(handler):
    """OptimizerVariable's `_init_group` handler, taking gradients the traced backward set."""

    def init_group(self, tx, args, kwargs):
        pending = _pending_grads(self, tx) if _tracing_tpuc() else None
        if not pending:
            return handler(self, tx, args, kwargs)
        real = {p: p.grad for p in pending}
        stand_ins = {}  # id(stand-in tensor) -> (tensor, the traced gradient's variable)

        def put_stand_ins(tx):  # in place of the pending-mutation graph break
            for p, grad_vt in pending.items():
                g = grad_vt.as_proxy().node.meta["example_value"]
                t = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device=g.device)
                stand_ins[id(t)] = (t, grad_vt)
                p.grad = t

        def guards_on_real_grads(tx):
            for p, g in real.items():
                p.grad = g
            return type(self).map_sources_and_install_guards(self, tx)

        def wrap_tensor(tx, t):
            hit = stand_ins.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            return type(self).wrap_tensor(self, tx, t)

        # Instance attributes shadow the three methods for this one call.
        self.__dict__.update(
            graph_break_if_pending_mutation=put_stand_ins,
            map_sources_and_install_guards=guards_on_real_grads,
            wrap_tensor=wrap_tensor,
        )
        try:
            return handler(self, tx, args, kwargs)
        finally:
            for p, g in real.items():
                p.grad = g
            for name in ("graph_break_if_pending_mutation", "map_sources_and_install_guards", "wrap_tensor"):
                self.__dict__.pop(name, None)

    return init_group


def _pending_grads(opt_vt, tx) -> dict | None:
    """{parameter: variable of its traced gradient} when the only pending writes on the
    optimizer's parameters are `.grad = tensor`; None otherwise (Dynamo then breaks the graph as
    usual)."""
    from torch._dynamo.variables.tensor import TensorVariable

    side = tx.output.side_effects
    pending = {}
    for group in opt_vt.value.param_groups:
        for p in group["params"]:
            v = side.id_to_variable.get(id(p))
            if v is None or not side.has_pending_mutation(v):
                continue
            if set(side.store_attr_mutations.get(v, ())) != {"grad"}:
                return None
            grad_vt = side.load_attr(v, "grad", deleted_ok=True)
            if not isinstance(grad_vt, TensorVariable):
                return None
            pending[p] = grad_vt
    return pending or None
