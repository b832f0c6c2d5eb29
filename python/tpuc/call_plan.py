"""The hot path of a call: the `CallPlan` of one executable (what does not change between calls,
computed once; python/src/hot.rs runs it), the resident-input lookup it asks, the output
allocator it uses, and the seed random ops take per call."""

from __future__ import annotations

import weakref

import torch

from . import _native, counters, residency
from .dtypes import _DTYPES, _host_array

# Output allocation on the hot path: Inductor's own allocator for CPU tensors (about 0.5 us, a
# quarter of `torch.empty(shape, dtype=...)`), where this torch has it.
_empty_strided = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_empty_strided = getattr(_empty_strided, "_empty_strided_cpu", None) or (
    lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
)


def _contiguous_strides(shape: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _call_plan(graph, exe, out_types, plan, floats, fallback=None) -> _native.CallPlan:
    """The hot path of calling `exe` (see python/src/hot.rs): everything about a call that does
    not change between calls, computed once. Per tensor input its position, shape and dtype
    (checked, then passed to Rust as a resident DeviceBuffer or a bare data pointer), per output
    its type (lent to torch in place on the CPU plugin, else copied into a fresh tensor), and
    how the graph's outputs are assembled. A call that does not fit the plan (a tensor on
    another device, non-contiguous, another shape or dtype) goes to `fallback` (the graph's
    general path; `try_call` returns None instead)."""
    inputs = [
        (i, tuple(shape), _DTYPES[dtype], graph.slots[i], _DTYPES[dtype].is_complex)
        for i, (shape, dtype) in zip(graph.tensor_slots, exe.input_types, strict=True)
    ]
    outputs = [(s, _contiguous_strides(s), d) for s, d in out_types]
    result = [
        int(v)
        if kind == "tensor"
        else ("input", int(v))
        if kind == "input"
        else ("value", int(v) if kind == "int" else None)
        for kind, v in plan
    ]
    return _native.CallPlan(
        exe,
        inputs,
        outputs,
        result,
        [*graph.attr_tensors, *floats],  # inputs after the caller's (fixed per executable)
        _rng_seed if graph.rng else None,  # then a fresh seed per call
        graph.device_arg,
        _empty_strided,
        _from_dlpack,
        fallback,
    )


_from_dlpack = torch._C._from_dlpack


def _residency(rt, mode: str = "auto"):
    """`device_arg(slot, t)`: the resident buffer of input tensor `t` at a position whose
    `_native.Slot` is `slot`, uploading it the second time the same storage comes back (or after
    it changed), else None. Holds the runtime, not the graph (call plans keep it).

    A resident buffer is reused while `residency.still_resident`; which buffers may stay resident
    at all is `residency.keeps_resident`'s rule: a buffer that is the tensor's memory reads
    whatever wrote it; a copy misses writes PyTorch does not version."""
    enabled, copies = residency.keeps_resident(rt, mode)
    align = rt.host_align if rt.host_zero_copy and not copies else 1

    def never(slot: _native.Slot, t: torch.Tensor):
        return None

    def device_arg(slot: _native.Slot, t: torch.Tensor):
        ptr = t.data_ptr()
        storage = t.untyped_storage()
        if residency.still_resident(slot, t, ptr, storage):
            return slot.buffer
        slot.tensor = slot.buffer = slot.storage = None
        if ptr % align:
            return None  # the plugin would copy it (see above)
        if slot.ref is not None and slot.ref() is storage:
            # Seen before at this position: keep it resident from now on.
            buffer = rt.upload(_host_array(t))
            counters.count_upload()
            if not (copies or buffer.aliases_host):
                slot.ref = None
                return None  # the plugin copied it after all (see above)
            slot.tensor, slot.version, slot.ptr, slot.storage = t, t._version, ptr, storage
            slot.aliased, slot.buffer = buffer.aliases_host, buffer
            return buffer
        slot.ref = weakref.ref(storage)
        return None

    # Read by the call plan, which then skips this call for tensors that cannot be resident:
    # an address off this alignment at a position with nothing resident (0: never resident).
    never.align = 0
    device_arg.align = align
    return device_arg if enabled else never


def _rng_seed() -> torch.Tensor:
    """Two random int64 words from torch's default generator: `torch.manual_seed` makes compiled
    random ops repeatable, and each call draws new numbers."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)
