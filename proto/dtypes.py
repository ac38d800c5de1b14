"""The tensor dtypes allowed on the wire, by their wire names. One place, so
the codec, tensor specs and plans check the same allow-list."""
from __future__ import annotations

import numpy
import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NUMPY_DTYPES = {d: numpy.dtype(n) for n, d in DTYPES.items() if n != "bfloat16"}  # numpy has no bfloat16
