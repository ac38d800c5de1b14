"""A gradient round's running sum, kept as flat runs when the pushes come as runs.

A push decoded from one pack frame knows its flat runs (runs.py): its
floating-point gradients of one dtype lie back to back in one buffer. A
round that copies and adds such pushes run by run does one kernel per run
instead of one per tensor, and its sum is again a dict that knows its runs,
so the optimizer steps on the sum's runs in place of gathering its tensors
(updater.py). Pushes without runs, or whose runs differ from the sum's, are
summed tensor by tensor into the same memory: the values are the same
either way, to the bit (the same additions, in the same order, per entry).
"""

from __future__ import annotations

from typing import Mapping

import torch

from hetps.proto.layout import aligned
from hetps.proto.runs import RunTensors


def _runs_of(tensors: Mapping[str, torch.Tensor]) -> list | None:
    return getattr(tensors, "runs", None) or None


def copy_sum(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A writable copy of `tensors` to sum into: each known run copied whole
    (its padding with it), its tensors views of the copy, which knows the
    copied runs as its own; every other tensor copied alone."""
    runs = _runs_of(tensors)
    if runs is None:
        return {n: t.clone() for n, t in tensors.items()}
    placed, own_runs = {}, []
    for run, names in runs:
        copy = padded_copy(run)
        start, size = run.data_ptr(), run.element_size()  # the run's tensors lie in its memory
        for n in names:
            t = tensors[n]
            placed[n] = copy.as_strided(t.shape, t.stride(), (t.data_ptr() - start) // size)
        own_runs.append((copy, names))  # the same list: a later push of the layout is known by it
    out = RunTensors((n, placed[n] if n in placed else t.clone()) for n, t in tensors.items())
    out.runs = own_runs
    return out


def padded_copy(run: torch.Tensor) -> torch.Tensor:
    """A copy of `run` that goes on to the ALIGN boundary after its last tensor,
    zero-filled: the length of the shard's flat run of the same tensors (arena.py),
    so the optimizer can step on the copy itself."""
    n = run.numel()
    copy = torch.empty(aligned(n * run.element_size()) // run.element_size(), dtype=run.dtype)
    copy[:n].copy_(run)
    copy[n:].zero_()
    return copy


def add_to_sum(total: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """`total` += `tensors`, name by name (`total` holds every name of
    `tensors`): floating-point tensors added, integer ones (BatchNorm's
    num_batches_tracked) kept at the largest. Runs that match the sum's
    (the same names, the same length) are added whole; a push decoded in the
    layout the sum was copied from (its runs' very name lists,
    known_layouts.py) is matched run for run with no search."""
    mine, theirs = _runs_of(total), _runs_of(tensors)
    done: set[str] = set()
    if mine is not None and theirs is not None:
        if len(mine) == len(theirs) and all(m[1] is t[1] for m, t in zip(mine, theirs)):
            for (target, _), (run, _) in zip(mine, theirs):
                target[: run.numel()].add_(run)  # padding stays zero
            if sum(len(names) for _, names in theirs) == len(tensors):
                return  # every tensor was in a run
            done = {n for _, names in theirs for n in names}
        else:
            done = _add_matching_runs(mine, theirs)
    for n in tensors:
        if n in done:
            continue
        t = tensors[n]
        if n not in total:  # an optional tensor the sum lacks so far
            total[n] = t.clone()
        elif t.is_floating_point():
            total[n].add_(t)
        else:
            torch.maximum(total[n], t, out=total[n])


def _add_matching_runs(mine: list, theirs: list) -> set[str]:
    """Add each of `theirs` runs whose names and length match one of `mine`; the names added."""
    done: set[str] = set()
    by_names = {tuple(names): run for run, names in mine}
    for run, names in theirs:
        target = by_names.get(tuple(names))
        if (
            target is not None
            and target.dtype == run.dtype
            and run.numel()
            <= target.numel()
            == aligned(run.numel() * run.element_size()) // run.element_size()
        ):
            # the same tensors at the same offsets; padding stays zero
            target[: run.numel()].add_(run)
            done.update(names)
    return done


def divide_sum(total: dict[str, torch.Tensor], k: float) -> dict[str, torch.Tensor]:
    """The mean, in place: every floating-point tensor of `total` divided by
    `k` (run by run where it knows its runs; a division by 1 is skipped, it
    changes no value). Returns `total`."""
    if k == 1:
        return total
    runs = _runs_of(total)
    in_runs = set()
    for run, names in runs or ():
        run.div_(k)
        in_runs.update(names)
    for n, t in total.items():
        if n not in in_runs and t.is_floating_point():
            t.div_(k)
    return total
