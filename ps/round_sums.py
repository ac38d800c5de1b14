"""A gradient round's running sum, kept as flat runs when the pushes come as runs.

A push decoded from one pack frame knows its flat runs (runs.py): its
floating-point gradients of one dtype lie back to back in one buffer. A
round that copies and adds such pushes run by run does one kernel per run
instead of one per tensor, and its sum is again a Tensors value that knows
its runs (proto/tensors.py), so the optimizer steps on the sum's runs in place of gathering its tensors
(updater.py). Pushes without runs, or whose runs differ from the sum's, are
summed tensor by tensor into the same memory: the values are the same
either way, to the bit (the same additions, in the same order, per entry).
"""

from __future__ import annotations

from typing import Mapping

import torch

from hetps.proto.layout import aligned
from hetps.proto.tensors import Run, RunSpec, Tensors


def _runs_of(tensors: Mapping[str, torch.Tensor]) -> tuple[Run, ...]:
    return tensors.runs if isinstance(tensors, Tensors) else ()


def _runs_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[RunSpec, ...]:
    return tensors.layout if isinstance(tensors, Tensors) else ()


def copy_sum(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """A writable copy of `tensors` to sum into: each known run copied whole
    (its padding with it), its tensors views of the copy, which knows the
    copied runs as its own (the same layout); every other tensor copied alone."""
    runs = _runs_of(tensors)
    if not runs:
        return Tensors((n, t.clone()) for n, t in tensors.items())
    placed, own_runs = {}, []
    for run, names in runs:
        copy = padded_copy(run)
        start, size = run.data_ptr(), run.element_size()  # the run's tensors lie in its memory
        for n in names:
            t = tensors[n]
            placed[n] = copy.as_strided(t.shape, t.stride(), (t.data_ptr() - start) // size)
        # the run's own length over the padded copy, so its spec is the push's (`Tensors.layout`)
        own_runs.append(Run(copy[: run.numel()], names))
    return Tensors(
        ((n, placed[n] if n in placed else t.clone()) for n, t in tensors.items()), own_runs
    )


def padded_copy(run: torch.Tensor) -> torch.Tensor:
    """A copy of `run` that goes on to the ALIGN boundary after its last tensor,
    zero-filled: the length of the shard's flat run of the same tensors (arena.py),
    so the optimizer can step on the copy itself (updater.py widens a run into it)."""
    n = run.numel()
    copy = torch.empty(aligned(n * run.element_size()) // run.element_size(), dtype=run.dtype)
    copy[:n].copy_(run)
    copy[n:].zero_()
    return copy


def add_to_sum(
    total: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """`total` += `tensors`, name by name, in place; returns the sum (`total`,
    or a new value when `tensors` has a name `total` lacks, an optional
    tensor: a Tensors cannot gain it in place). Floating-point tensors
    added, integer ones (BatchNorm's num_batches_tracked) kept at the
    largest. Runs that match the sum's (the same names, the same length)
    are added whole; a push in the layout the sum was copied from (equal
    `Tensors.layout`) is matched run for run with no search."""
    mine, theirs = _runs_of(total), _runs_of(tensors)
    done: set[str] = set()
    if mine and theirs:
        if _runs_layout(total) == _runs_layout(tensors):
            for (target, _), (run, _) in zip(mine, theirs):
                target.add_(run)  # padding stays zero
            if sum(len(names) for _, names in theirs) == len(tensors):
                return total  # every tensor was in a run
            done = {n for _, names in theirs for n in names}
        else:
            done = _add_matching_runs(mine, theirs)
    missing = {}
    for n in tensors:
        if n in done:
            continue
        t = tensors[n]
        if n not in total:  # an optional tensor the sum lacks so far
            missing[n] = t.clone()
        elif t.is_floating_point():
            total[n].add_(t)
        else:
            torch.maximum(total[n], t, out=total[n])
    if not missing:
        return total
    if isinstance(total, dict):  # a plain dict (a round restored from a checkpoint)
        total.update(missing)
        return total
    return Tensors({**total, **missing}, _runs_of(total))


def _add_matching_runs(mine: tuple[Run, ...], theirs: tuple[Run, ...]) -> set[str]:
    """Add each of `theirs` runs whose names, dtype and length match one of `mine`; the names added."""
    done: set[str] = set()
    by_names = {names: run for run, names in mine}
    for run, names in theirs:
        target = by_names.get(names)
        if target is not None and target.dtype == run.dtype and target.numel() == run.numel():
            # the same tensors at the same offsets; padding stays zero
            target.add_(run)
            done.update(names)
    return done


def divide_sum(total: Mapping[str, torch.Tensor], k: float) -> Mapping[str, torch.Tensor]:
    """The mean, in place: every floating-point tensor of `total` divided by
    `k` (run by run where it knows its runs; a division by 1 is skipped, it
    changes no value). Returns `total`."""
    if k == 1:
        return total
    in_runs = set()
    for run, names in _runs_of(total):
        run.div_(k)
        in_runs.update(names)
    for n, t in total.items():
        if n not in in_runs and t.is_floating_point():
            t.div_(k)
    return total
