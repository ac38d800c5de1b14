"""`cluster.nonfinite` at the shard: what a push holding NaN or Inf gets, the same for
dense pushes and sparse row pushes (each path finds its bad values and mends a skipped
push its own way)."""

from __future__ import annotations

import torch

from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Status
from hetps.runconfig.schema import ClusterConfig


class NonfiniteScreen:
    """`reject` refuses the push (NONFINITE, nothing of it recorded); `skip` and `clip` let
    it through, mended by the caller (`clipped`: NaN -> 0, +-Inf -> +-clip_value). Every
    push found bad counts once in `counts["nonfinite"]` (the shard's counters)."""

    def __init__(self, cluster: ClusterConfig, counts: dict):
        self.cluster = cluster
        self.counts = counts

    def verdict(self, bad: list[str], refusal: str) -> str | None:
        """None when `bad` (the names holding NaN/Inf) is empty; else the push is counted
        and, under `reject`, refused: ProtocolError(NONFINITE, `refusal` formatted with
        bad[0]'s repr); otherwise the mode it is mended by, "skip" or "clip"."""
        if not bad:
            return None
        self.counts["nonfinite"] += 1
        if self.cluster.nonfinite == "reject":
            raise ProtocolError(Status.NONFINITE, refusal.format(repr(bad[0])))
        return self.cluster.nonfinite

    def clipped(self, values: torch.Tensor) -> torch.Tensor:
        """`values` with NaN as 0 and +-Inf as +-clip_value (a new tensor)."""
        clip = self.cluster.clip_value
        return torch.nan_to_num(values, nan=0.0, posinf=clip, neginf=-clip)
