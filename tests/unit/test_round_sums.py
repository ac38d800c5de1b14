"""A gradient round's sum (ps/round_sums.py, Round in ps/policies/base.py):
pushes decoded from one pack frame are copied, added and divided run by run,
and the mean equals, to the bit, the per-tensor sum of the same pushes; the
mean knows its runs, so the optimizer steps on them; a round that closes in
the call that opened it keeps the push as it is, and never writes a peer's
memory. Pure, in one process."""

from __future__ import annotations

import pytest
import torch

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Push
from hetps.proto.runs import flat_runs
from hetps.proto.tensors import Tensors
from hetps.ps import round_sums
from hetps.ps.policies.base import Round
from hetps.ps.round_sums import add_to_sum, copy_sum, divide_sum

# odd sizes (padding between tensors in the frame), two float dtypes, an integer tensor
SHAPES = {
    "a.weight": ((3, 5), torch.float32),
    "a.bias": ((3,), torch.float32),
    "steps": ((), torch.int64),
    "b.weight": ((2, 7), torch.float64),
    "b.bias": ((7,), torch.float32),
}


def push_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(shape, generator=g, dtype=dtype)
        if dtype.is_floating_point
        else torch.tensor(seed, dtype=dtype)
        for n, (shape, dtype) in SHAPES.items()
    }


def decoded(tensors: dict) -> Tensors:
    """As a shard receives them: read-only views of one pack frame, with their runs."""
    out = decode(encode(Push(plan_id=1, clock=0, base_version=0, tensors=tensors))).msg.tensors
    assert out.runs, "the decoder found the frame's runs"
    return out


def per_tensor_mean(pushes: list[dict], k: int) -> dict:
    total = {n: t.clone() for n, t in pushes[0].items()}
    for p in pushes[1:]:
        for n, t in p.items():
            total[n].add_(t) if t.is_floating_point() else torch.maximum(total[n], t, out=total[n])
    return {n: t.div_(k) if t.is_floating_point() else t for n, t in total.items()}


@pytest.mark.parametrize("kinds", ["runs", "plain", "runs-then-plain", "plain-then-runs"])
@pytest.mark.parametrize("members", [1, 2, 3])
def test_the_sum_by_runs_equals_the_per_tensor_sum_bit_for_bit(kinds, members):
    plain = [push_tensors(seed) for seed in range(members)]
    pushes = [
        decoded(p)
        if (
            kinds == "runs"
            or (kinds == "runs-then-plain" and i == 0)
            or (kinds == "plain-then-runs" and i > 0)
        )
        else p
        for i, p in enumerate(plain)
    ]
    frames_before = [{n: t.clone() for n, t in p.items()} for p in pushes]
    total = copy_sum(pushes[0])
    for p in pushes[1:]:
        total = add_to_sum(total, p)
    mean = divide_sum(total, members)
    expected = per_tensor_mean(plain, members)
    assert list(mean) == list(expected)
    for n in expected:
        assert mean[n].dtype == expected[n].dtype and torch.equal(mean[n], expected[n]), n
    for p, before in zip(pushes, frames_before):  # the pushes are read, never written
        for n in p:
            assert torch.equal(p[n], before[n]), n
    if kinds in ("runs", "runs-then-plain"):  # the sum knows its runs: each tensor a view of one
        for run, names in mean.runs:
            for n in names:
                assert mean[n].untyped_storage().data_ptr() == run.untyped_storage().data_ptr(), n
        assert [names for _, names in mean.runs] == [names for _, names in flat_runs(pushes[0])]


def test_a_round_sums_decoded_pushes_by_runs_and_its_mean_knows_them(monkeypatch):
    """Pushes of the sum's layout (equal `Tensors.layout`) are added run for
    run with no search; the mean is a Tensors that knows its runs."""
    monkeypatch.setattr(round_sums, "_add_matching_runs", None)  # never searched
    pushes = [decoded(push_tensors(seed)) for seed in range(3)]
    rnd = Round()
    for worker, p in enumerate(pushes):
        rnd.add(worker, p, {})
        assert rnd.grads.layout == p.layout
    grads, _ = rnd.means()
    assert isinstance(grads, Tensors) and grads.runs and not rnd.borrowed
    expected = per_tensor_mean([push_tensors(seed) for seed in range(3)], 3)
    for n in expected:
        assert torch.equal(grads[n], expected[n]), n


def test_a_borrowing_round_keeps_the_push_and_copies_it_only_to_divide():
    """A round closed in the call that opened it keeps the peer's tensors
    (no copy); dividing them (a mean over more than its one member, as eager
    quorums make) copies first, so the peer's frame is never written."""
    push = decoded(push_tensors(7))
    before = {n: t.clone() for n, t in push.items()}
    kept = Round()
    kept.add(1, push, {}, borrow=True)
    grads, _ = kept.means()
    assert grads is push  # a mean over one member: the push itself
    divided = Round()
    divided.add(1, push, {}, borrow=True)
    grads, _ = divided.means(over=4)
    assert grads is not push and isinstance(grads, Tensors) and grads.runs
    for n, t in before.items():
        assert torch.equal(push[n], t), n  # untouched
        expected = t / 4 if t.is_floating_point() else t
        assert torch.equal(grads[n], expected), n


def test_a_second_member_after_a_borrowed_first_adds_into_a_copy():
    first, second = decoded(push_tensors(1)), decoded(push_tensors(2))
    before = {n: t.clone() for n, t in first.items()}
    rnd = Round()
    rnd.add(1, first, {}, borrow=True)
    rnd.add(2, second, {})
    grads, _ = rnd.means()
    expected = per_tensor_mean([push_tensors(1), push_tensors(2)], 2)
    for n in expected:
        assert torch.equal(grads[n], expected[n]), n
        assert torch.equal(first[n], before[n]), n
