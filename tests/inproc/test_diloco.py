"""diloco on a shard, in process: each pushed pseudo-gradient is applied at
once by the outer optimizer; the result equals an independently computed
Nesterov step (plain and delayed), staleness is the shard updates since the
worker's start version, and the worker's local steps follow speed."""

from __future__ import annotations

import torch
from shard_harness import ShardHarness, grads, tiny_model, values_of

from hetps.proto.messages import Params, Pull, Push
from hetps.training.state import model_specs

A, B = 11, 12


def push(h: ShardHarness, node: int, clock: int, tensors: dict, base_version: int):
    c = h.client(node)
    req = c.send(
        Push(
            plan_id=h.plan_id,
            clock=clock,
            base_version=base_version,
            n_samples=32,
            tensors=tensors,
        )
    )
    h.serve()
    return c.wait(req, timeout_s=2.0)


def current(h: ShardHarness) -> dict:
    c = h.client(A)
    req = c.send(Pull(plan_id=h.plan_id, clock=-1))
    h.serve()
    reply = c.wait(req, timeout_s=2.0)
    assert isinstance(reply, Params)
    return {n: t.clone() for n, t in reply.tensors.items()}


def run_pushes(overrides: list[str], n_pushes: int):
    """Pushes alternating A, B, each a seeded pseudo-gradient; returns (start, pushed, final, acks)."""
    model = tiny_model()
    h = ShardHarness(model_specs(model), overrides, [A, B], algorithm="diloco")
    try:
        start = values_of(model)
        h.init(start)
        pushed, acks = [], []
        for t in range(n_pushes):
            node = (A, B)[t % 2]
            g = grads(model, 100 + t)
            pushed.append(g)
            acks.append(push(h, node, t // 2, g, base_version=max(0, t - 1)))
        return start, pushed, current(h), acks, h.params()
    finally:
        h.close()


def test_each_push_is_one_outer_nesterov_step():
    lr, beta = 0.7, 0.9
    start, pushed, final, acks, params = run_pushes(
        [
            f"algorithm.outer_lr={lr}",
            f"algorithm.outer_momentum={beta}",
            "algorithm.delay=1",
            "algorithm.per_worker_lr=false",
        ],
        3,
    )
    for name in params:  # Nesterov, written out: v <- beta v + g; x <- x - lr (g + beta v)
        x, v = start[name].clone(), torch.zeros_like(start[name])
        for g in pushed:
            v = beta * v + g[name]
            x = x - lr * (g[name] + beta * v)
        torch.testing.assert_close(final[name], x, rtol=0, atol=1e-5)
    assert [a.version for a in acks] == [1, 2, 3]


def test_per_worker_lr_divides_the_outer_lr_by_the_workers():
    lr, beta = 0.7, 0.9
    start, pushed, final, _, params = run_pushes(
        [f"algorithm.outer_lr={lr}", f"algorithm.outer_momentum={beta}", "algorithm.delay=1"], 2
    )
    for name in params:
        x, v = start[name].clone(), torch.zeros_like(start[name])
        for g in pushed:
            v = beta * v + g[name]
            x = x - lr / 2 * (g[name] + beta * v)
        torch.testing.assert_close(final[name], x, rtol=0, atol=1e-5)


def test_delayed_nesterov_moves_momentum_every_nth_push():
    lr, beta, delay = 0.5, 0.8, 2
    start, pushed, final, _, params = run_pushes(
        [
            f"algorithm.outer_lr={lr}",
            f"algorithm.outer_momentum={beta}",
            f"algorithm.delay={delay}",
            "algorithm.per_worker_lr=false",
        ],
        5,
    )
    for name in params:  # arXiv 2401.09135, delayed Nesterov, written out
        x, m, acc = (
            start[name].clone(),
            torch.zeros_like(start[name]),
            torch.zeros_like(start[name]),
        )
        for t, g in enumerate(pushed, 1):
            acc = acc + g[name]
            if t % delay == 0:
                m = beta * m + acc / delay
                acc = torch.zeros_like(acc)
                x = x - lr * (g[name] + beta * m)
            else:
                x = x - lr * g[name]
        torch.testing.assert_close(final[name], x, rtol=0, atol=1e-5)


def test_staleness_is_the_updates_since_the_workers_start_version():
    _, _, _, acks, _ = run_pushes(["algorithm.delay=1"], 4)
    # push t starts from version max(0, t - 1) and meets version t: 0, then 1 update applied since, each
    assert [a.staleness for a in acks] == [0, 1, 1, 1]


def test_the_outer_optimizer_is_not_the_workers_inner_one():
    """`optimizer:` configures the workers; the shard steps with outer_lr, whatever optimizer.lr says."""
    lr = 0.3
    start, pushed, final, _, params = run_pushes(
        [
            "optimizer.name=adamw",
            "optimizer.lr=0.001",
            f"algorithm.outer_lr={lr}",
            "algorithm.outer_momentum=0",
            "algorithm.delay=1",
            "algorithm.per_worker_lr=false",
        ],
        1,
    )
    for name in params:
        torch.testing.assert_close(
            final[name], start[name] - lr * pushed[0][name], rtol=0, atol=1e-6
        )
