"""Optimizer state between its flat form and the per-tensor form.

An optimizer over an arena's flat runs (arena.py) holds one state entry per
run (a momentum buffer the size of the run, Adam's moments and step). A
checkpoint keeps the per-tensor form, as an optimizer over the separate
tensors would write it: param i is the i-th parameter of the shard in spec
order, with state the tensor's own size. So a checkpoint reads the same
whichever way the shard lays its memory out, and either kind restores into
either. Pure functions over state dicts; nothing here steps an optimizer.
"""

from __future__ import annotations

import torch

from .arena import Arena

SHARED = ("step",)  # per-tensor state that is one scalar, the same for every tensor of a step


def per_tensor_state(flat_state: dict, arena: Arena, names: list[str]) -> dict:
    """`flat_state` (an optimizer's state_dict over `arena.flat`, in its
    order) as the state_dict of the same optimizer over the tensors `names`."""
    runs = list(arena.flat)
    state = {}
    for i, name in enumerate(names):
        entry = flat_state["state"].get(runs.index(arena.views[name].dtype))
        if entry is not None:
            state[i] = {key: _slice(key, value, arena, name) for key, value in entry.items()}
    groups = [{**g, "params": list(range(len(names)))} for g in flat_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def flat_state(tensor_state: dict, arena: Arena, names: list[str]) -> dict:
    """The inverse of `per_tensor_state`: per-tensor state (param i = names[i])
    as the state_dict of the optimizer over `arena.flat`. Raises ValueError
    when only some tensors of a run have state."""
    index = {n: i for i, n in enumerate(names)}
    state = {}
    for run, (dtype, flat) in enumerate(arena.flat.items()):
        members = arena.run_names(dtype)
        entries = [tensor_state["state"].get(index[n]) for n in members]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise ValueError("optimizer state holds some tensors of a run and not others")
        state[run] = {
            key: entries[0][key]
            if key in SHARED
            else _join([e[key] for e in entries], members, arena, flat)
            for key in entries[0]
        }
    groups = [{**g, "params": list(range(len(arena.flat)))} for g in tensor_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def _slice(key: str, value, arena: Arena, name: str):
    if key in SHARED or not isinstance(value, torch.Tensor):
        return value.clone() if isinstance(value, torch.Tensor) else value
    view = arena.views[name]
    start = arena.offset_in_run(name)
    return value[start : start + view.numel()].view(view.shape).clone()


def _join(values: list, names: list[str], arena: Arena, flat: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(flat.shape, dtype=values[0].dtype)  # padding entries stay zero
    for value, name in zip(values, names):
        start = arena.offset_in_run(name)
        out[start : start + arena.views[name].numel()].copy_(value.reshape(-1))
    return out
