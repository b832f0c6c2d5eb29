"""When an input may stay resident on the device, and when a resident buffer is still its
tensor's: the rule unsharded graphs (`call_plan._residency`), sharded ones
(`ShardedGraph._resident`) and loops' kept stacks of parameters (`block_loops.StackedInputs`)
share. The call plan applies the same test in Rust (hot.rs)."""

from __future__ import annotations


def keeps_resident(rt, mode: str) -> tuple[bool, bool]:
    """(whether inputs may stay resident, whether a resident buffer may be a copy) for option
    `residency` on runtime `rt`. A copy is only current while nothing wrote the tensor's memory
    behind PyTorch's version counter (`p.data.mul_`, FSDP2 filling its unsharded parameters), so
    by default ("auto") only buffers that are the memory itself stay resident: on the CPU
    plugin, 64-byte-aligned tensors; on discrete devices nothing (uploaded every call).
    "versioned" keeps copies too (the caller promises versioned writes); "off" keeps nothing."""
    if mode == "off":
        return False, False
    if mode == "versioned":
        return True, True
    return rt.host_zero_copy, False


def still_resident(slot, t, ptr: int, storage) -> bool:
    """Whether `slot`'s resident buffer still stands for `t` (whose `data_ptr()` is `ptr` and
    `untyped_storage()` is `storage`): the same tensor at the same address and, for a copy, the
    same `_version` and storage. `.data =`, `module.to(dtype)`, swap_tensors and FSDP's storage
    resizes change the memory without bumping the version. A buffer that is the tensor's memory
    (`aliased`) reads its current bytes, so an in-place write (a KV cache at every step) keeps
    it resident; the caller has checked shape, dtype and layout."""
    return (
        slot.tensor is t
        and slot.ptr == ptr
        and (slot.aliased or (slot.version == t._version and slot.storage is storage))
    )
