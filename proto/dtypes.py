"""The tensor dtypes allowed on the wire, by their wire names. One place, so
the codec, tensor specs and plans check the same allow-list.

`ITEMSIZES` needs no torch: the scheduler and `hetps run` check tensor specs
without importing it (seconds of start-up on a loaded machine). `DTYPES`,
`DTYPE_NAMES` and `NUMPY_DTYPES` import torch on first use.
"""

from __future__ import annotations

ITEMSIZES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "bool": 1,
}
_LAZY = ("DTYPES", "DTYPE_NAMES", "NUMPY_DTYPES")


def __getattr__(name: str):
    """The torch/numpy tables, built on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numpy
    import torch

    dtypes = {n: getattr(torch, n) for n in ITEMSIZES}
    globals().update(
        DTYPES=dtypes,
        DTYPE_NAMES={v: k for k, v in dtypes.items()},
        # no bfloat16
        NUMPY_DTYPES={d: numpy.dtype(n) for n, d in dtypes.items() if n != "bfloat16"},
    )
    return globals()[name]
