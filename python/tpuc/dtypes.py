"""torch dtypes by the names the native module uses, and a tensor as the host array it takes."""

from __future__ import annotations

import torch

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "uint64": torch.uint64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _host_array(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.nbytes, _DTYPE_NAMES[t.dtype], list(t.shape))
