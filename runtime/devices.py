"""Which device a worker computes on: `cluster.workers[i].device` is `auto`,
`cpu`, `cuda` or `cuda:N`.

`hetps run` resolves `auto` for its local workers with `assign_devices`:
round-robin over the GPUs visible to it (CUDA_VISIBLE_DEVICES applies), the
CPU when there are none. A worker started on its own (`hetps worker`, one
per host or container) resolves `auto` to `cuda` (its first visible GPU)
when there is one, else the CPU.
"""

from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
ALLOWED = "auto, cpu, cuda, cuda:N"


class DeviceUnavailable(RuntimeError):
    """The configured device does not exist on this host."""


def assign_devices(requested: list[str], gpu_count: int) -> list[str]:
    """The device of each local worker: `auto` entries take cuda:0, cuda:1, ...
    in turn (wrapping around) when `gpu_count` > 0, else `cpu`; explicit
    devices stay as they are. Pure: the caller counts the GPUs."""
    out, turn = [], 0
    for name in requested:
        if name == "auto":
            name = f"cuda:{turn % gpu_count}" if gpu_count else "cpu"
            turn += 1
        out.append(name)
    return out


def local_gpu_count() -> int:
    """GPUs visible to torch on this host. Without a GPU device node (NVIDIA,
    AMD, WSL) or with CUDA_VISIBLE_DEVICES empty it is 0 without importing
    torch, which costs `hetps run` seconds before it starts any process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    if not (
        glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")
    ):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(name: str, where: str = "device") -> torch.device:
    """The torch device for a configured name. Raises DeviceUnavailable, naming
    `where` (the config key), when it asks for a GPU this host does not have."""
    import torch

    if not DEVICE_PATTERN.fullmatch(name):
        raise DeviceUnavailable(f"{where}: unknown value {name!r}; allowed: {ALLOWED}")
    count = torch.cuda.device_count() if name != "cpu" else 0
    if name == "auto":
        name = "cuda" if count and torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= count):
        raise DeviceUnavailable(
            f"{where}: {name} asked for, but this host has {count} CUDA device(s) "
            f"visible to torch{'' if torch.cuda.is_available() else ' (CUDA not available)'}; "
            "use auto or cpu"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # an index, for torch.cuda.set_device and for the log
    return device


def use_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (no-op on the CPU), so
    that calls without a device (synchronize, pinned allocations) act on it
    and no other GPU gets a context of this process."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
