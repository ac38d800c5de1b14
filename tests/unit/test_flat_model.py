"""A worker's flat parameters and gradients (worker/flat_model.py): each
shard's part of the model lives in one value buffer and one gradient buffer
in the wire's pack layout. Backward gives the per-tensor gradients (added
into zeros: a -0.0 comes out +0.0, an equal value; none occurs in these
steps); a push's frame is the gradient buffer itself and its bytes are those
the per-tensor encoder makes; a reply loads with one copy per part; parts
that do not qualify keep the per-tensor path. Pure, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Params, Push
from hetps.proto.tensors import Tensors
from hetps.training.models import LeNet5
from hetps.training.state import ModelState, model_specs

STEPS = 3


def two_parts(model: nn.Module) -> list[list[str]]:
    names = [s.name for s in model_specs(model)]
    return [names[:4], names[4:]]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)


def backward(state: ModelState, step: int) -> None:
    x, y = batch(step)
    state.zero_grad()
    F.cross_entropy(state.model(x), y).backward()


def push_frames(state: ModelState, names: list[str], step: int) -> list:
    out = state.outgoing()
    return encode(
        Push(plan_id=1, clock=step, base_version=step, tensors={n: out[n] for n in names}), 7, 3
    )


def reply_for(values: dict[str, torch.Tensor], names: list[str]) -> Tensors:
    """What a shard's reply decodes to: read-only views of one frame, with their runs."""
    got = decode(encode(Params(version=1, tensors={n: values[n] for n in names}), 7, 1)).msg.tensors
    assert isinstance(got, Tensors) and got.runs  # the decoder's runs: the fast path is taken
    return got


@pytest.fixture
def pair():
    torch.manual_seed(0)
    plain = LeNet5((1, 28, 28), 10)
    flat = copy.deepcopy(plain)
    flat_state = ModelState(flat, torch.device("cpu"))
    flat_state.lay_out_flat(two_parts(flat))
    return ModelState(plain, torch.device("cpu")), flat_state


def test_training_steps_match_the_per_tensor_model(pair):
    """Backward into the flat gradients, the push frames, and the values a
    reply loads: equal to the per-tensor model's at every step."""
    plain, flat = pair
    parts = two_parts(plain.model)
    assert [p.names for p in flat.flat.parts] == [tuple(n) for n in parts]
    grad_buffers = [p.grads.data_ptr() for p in flat.flat.parts]
    for step in range(STEPS):
        backward(plain, step)
        backward(flat, step)
        for names, part in zip(parts, flat.flat.parts):
            plain_frames, flat_frames = (
                push_frames(plain, names, step),
                push_frames(flat, names, step),
            )
            assert [bytes(memoryview(f)) for f in flat_frames] == [
                bytes(memoryview(f)) for f in plain_frames
            ]
            # the frame is the gradient buffer itself, not a joined copy
            assert (
                torch.frombuffer(flat_frames[-1], dtype=torch.uint8).data_ptr()
                == part.grads.data_ptr()
            )
        new = {n: t - 0.1 * (step + 1) for n, t in plain.values().items()}
        plain.load(Tensors.merge(reply_for(new, names) for names in parts))
        flat.load(Tensors.merge(reply_for(new, names) for names in parts))
        for (n, a), (_, b) in zip(plain.model.named_parameters(), flat.model.named_parameters()):
            assert torch.equal(a, b) and torch.equal(a, new[n]), n
    assert [p.grads.data_ptr() for p in flat.flat.parts] == grad_buffers  # never re-allocated


def test_a_reply_loads_with_one_copy_per_part(pair, monkeypatch):
    _, flat = pair
    parts = two_parts(flat.model)
    new = {n: torch.full_like(t, 0.5) for n, t in flat.values().items()}
    copies = []
    real_copy = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        copies.append(self.data_ptr())
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    flat.load(Tensors.merge(reply_for(new, names) for names in parts))
    monkeypatch.undo()
    assert copies == [part.span.data_ptr() for part in flat.flat.parts]
    for n, p in flat.model.named_parameters():
        assert torch.equal(p, new[n]), n


def test_values_without_runs_load_tensor_by_tensor(pair):
    _, flat = pair
    new = {n: torch.full_like(t, -2.0) for n, t in flat.values().items()}
    flat.load(new)  # a plain dict: no runs known
    for n, p in flat.model.named_parameters():
        assert torch.equal(p, new[n]), n


def test_parts_that_do_not_qualify_keep_the_per_tensor_path():
    """Buffers (BatchNorm), two dtypes in one part, a parameter shared under two names,
    a chunk part the model does not have: not laid out; the rest still is."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[3].double()
    state = ModelState(model, torch.device("cpu"))
    names = list(state.tensors)
    bn = [n for n in names if n.startswith("1.")]
    state.lay_out_flat(
        [
            ["0.weight", "0.bias"],
            bn,
            ["2.weight", "2.bias", "3.weight", "3.bias"],
            ["0.weight#part0"],
        ]
    )
    assert [p.names for p in state.flat.parts] == [("0.weight", "0.bias")]
    state.zero_grad()
    assert model[1].weight.grad is None and model[3].weight.grad is None  # per tensor: set to None
    assert not model[0].weight.grad.any()  # flat: zeroed in place
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    tied_state = ModelState(tied, torch.device("cpu"))
    tied_state.lay_out_flat([list(tied_state.tensors)])
    assert tied_state.flat.parts == []  # one Parameter under two names: never re-seated
