"""`comm.overlap`: pushes during backward, pulls waited for per layer in the
next forward (worker/overlap.py), against the plain step, with real Shards
on in-process `mem://` transports served by a thread, and the real worker
loops (Trainer, OverlapTrainer) driven by a stand-in for Membership.

Overlap on and off must give BIT-IDENTICAL parameters and per-step losses:
overlap changes when messages travel, not what they hold. With 2 workers a
sync round's mean is (g_a + g_b) / 2 whichever push arrives first (float
addition of two terms is commutative), the shard's SGD is deterministic,
and every worker computes on one torch thread. Identical losses at every
step also show that each forward ran on the freshly pulled values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest
import torch
from cluster_util import wait_for
from shard_harness import SHARD_IDS, ShardHarness

from hetps.proto.plan import NodeEntry, chunk_specs
from hetps.proto.rpc import Aborted, RequestTimeout
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import NodeConfig
from hetps.training.data import load_datasets
from hetps.training.models import build_model
from hetps.training.state import ModelState, model_specs
from hetps.worker.lifecycle import trainer_class
from hetps.worker.local import LocalSgdTrainer
from hetps.worker.overlap import Overlap, OverlapTrainer
from hetps.worker.trainer import Trainer

WORKERS = (1, 2)
STEPS = 6
OVERRIDES = [
    "model.name=resnet20",
    "data.dataset=synthetic",
    "data.synthetic.shape=[3,8,8]",
    "data.synthetic.train_size=128",
    "data.synthetic.test_size=16",
    "data.batch_size=8",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "cluster.workers=2",
    "cluster.retry_s=0",
]
JOIN_S = 60.0


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class StandInMember:
    """What a Trainer uses of Membership: ids, the stop flag, step records, the socket
    options (none: the defaults). Asks the loop to stop after `steps` steps."""

    transport = None

    def __init__(self, node_id: int, rank: int, steps: int):
        self.node_id, self.rank, self.steps = node_id, rank, steps
        self.stop_requested = threading.Event()
        self.records: list[dict] = []
        self.plans_named: set[int] = set()

    def note_plan(self, plan_id: int) -> None:
        self.plans_named.add(plan_id)  # the plans the shards' ACKs named

    def newer_plan(self, current: int):
        return None

    def add_record(self, record: dict) -> None:
        self.records.append(record)
        if record["step"] >= self.steps:
            self.stop_requested.set()


@contextlib.contextmanager
def serving(harness: ShardHarness):
    """Serve the harness's shards from a thread until the block ends."""
    done = threading.Event()

    def loop():
        while not done.is_set():
            for shard in harness.shards:
                shard.serve_once(0.002)

    thread = threading.Thread(target=loop, name="test-shards", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


def setup(make, overrides: list[str], n_shards: int, chunk_bytes: int = 0):
    """Shards for the model of `overrides` (chunked if asked) and the plan workers see."""
    cfg = load_config(None, ["algorithm.name=sync", *OVERRIDES, *overrides])
    data = load_datasets(cfg.data, cfg.seed)
    specs, chunks = chunk_specs(
        model_specs(build_model(cfg.model, data.in_shape, data.num_classes)), chunk_bytes
    )
    harness = make(specs, [*OVERRIDES, *overrides], WORKERS, n_shards)
    plan = dataclasses.replace(
        harness.plan,
        chunks=chunks,
        shards=[NodeEntry(SHARD_IDS[i], i, a) for i, a in enumerate(harness.addresses)],
    )
    for shard in harness.shards:
        shard.adopt(plan)
    return cfg, data, harness, plan


def make_trainers(cfg, data, plan, steps: int, workers=WORKERS) -> list[Trainer]:
    trainers = []
    for rank, node in enumerate(workers):
        torch.manual_seed(cfg.seed)  # all workers start equal, as the daemons do
        model = build_model(cfg.model, data.in_shape, data.num_classes)
        trainers.append(
            trainer_class(cfg)(
                cfg,
                NodeConfig(),
                StandInMember(node, rank, steps),
                plan,
                ModelState(model, torch.device("cpu")),
                data,
            )
        )
    return trainers


def run_workers(trainers: list[Trainer], timeout_s: float = JOIN_S) -> list[BaseException | None]:
    """Each trainer's run() and close() on its own thread; the exception each ended with."""
    errors: list[BaseException | None] = [None] * len(trainers)

    def work(i: int) -> None:
        try:
            trainers[i].run()
        except BaseException as exc:
            errors[i] = exc
        finally:
            trainers[i].close()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(trainers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return errors


def train(make, overlap: bool, n_shards: int, chunk_bytes: int = 0, extra: tuple = ()):
    """STEPS sync steps of 2 workers; the shards' values and each worker's losses."""
    cfg, data, harness, plan = setup(
        make, [f"comm.overlap={str(overlap).lower()}", *extra], n_shards, chunk_bytes
    )
    trainers = make_trainers(cfg, data, plan, STEPS)
    assert all(type(t) is (OverlapTrainer if overlap else Trainer) for t in trainers)
    # Trainer keeps a shard's part flat (worker/flat_model.py) when it is parameters of one dtype (LeNet-5's,
    # not ResNet-20's with BatchNorm buffers), not chunked and not compressed; OverlapTrainer never does
    flat = [len(t.state.flat.parts) if t.state.flat is not None else 0 for t in trainers]
    if "model.name=lenet5" in extra and not (overlap or chunk_bytes):
        assert flat == [n_shards] * len(trainers)
    if overlap:
        assert not any(flat)
    with serving(harness):
        assert run_workers(trainers) == [None, None]
        wait_for(lambda: harness.versions() == [STEPS] * n_shards, 10, "every round applied")
    # each ACK names the shard's plan
    assert all(t.member.plans_named == {plan.plan_id} for t in trainers)
    losses = [[r["loss"] for r in t.member.records] for t in trainers]
    return harness.values(), losses, plan


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "n_shards,chunk_bytes,extra",
    [
        (1, 0, ()),
        (2, 0, ()),
        (2, 4096, ()),
        # the push hook, with per-tensor state
        (2, 4096, ("comm.compression=topk", "comm.topk_ratio=0.1")),
        (2, 4096, ("comm.fuse_pull=false",)),  # a PUSH and a PULL per shard
        # no buffers: Trainer's parts are flat
        (2, 0, ("model.name=lenet5", "data.synthetic.shape=[1,28,28]")),
    ],
)
def test_overlap_on_and_off_give_identical_parameters(harnesses, n_shards, chunk_bytes, extra):
    values_off, losses_off, plan = train(harnesses, False, n_shards, chunk_bytes, extra)
    values_on, losses_on, _ = train(harnesses, True, n_shards, chunk_bytes, extra)
    assert all(len(ls) == STEPS for ls in losses_on + losses_off)
    assert losses_on == losses_off
    assert_identical(values_on, values_off)
    if chunk_bytes:  # the case worth testing: one tensor's parts on both shards
        assert any(len({plan.placement[p] for p in c["parts"]}) == 2 for c in plan.chunks.values())


def test_top_shard_pushes_while_bottom_backward_runs(harnesses):
    cfg, data, harness, plan = setup(harnesses, [], 2)
    # a plain Trainer: the hooks by hand
    (trainer,) = make_trainers(cfg, data, plan, 1, workers=WORKERS[:1])
    bottom = trainer.state.tensors["stem.0.weight"][0]  # the first layer: its gradient comes last
    seen = []
    bottom.register_post_accumulate_grad_hook(lambda p: seen.append(list(overlap.pending)))
    overlap = Overlap(trainer.client, trainer.state, trainer.should_abort)  # hooks after ours
    try:
        overlap.begin(0, 8)
        trainer.compute()
        # shard 1 left, shard 0 waited
        assert seen and seen[0][1] is not None and seen[0][0] is None
        # and left when its last gradient came
        assert overlap.pending[0] is not None
    finally:
        trainer.member.stop_requested.set()  # the links' waits (no shard serves them here) give up
        assert overlap.close()
        trainer.client.close()


def blocked_worker(make, overrides: list[str]):
    """One worker of a 2-worker sync plan, alone: its first step's pulls can never be answered."""
    cfg, data, harness, plan = setup(make, ["comm.overlap=true", *overrides], 2)
    (trainer,) = make_trainers(cfg, data, plan, 10, workers=WORKERS[:1])
    return trainer, harness


def link_threads(trainer: OverlapTrainer) -> list[threading.Thread]:
    """The trainer's link threads still alive."""
    return [link.thread for link in trainer.overlap.links if link.thread.is_alive()]


def test_stop_during_an_overlapped_step_does_not_hang(harnesses):
    trainer, harness = blocked_worker(harnesses, [])
    with serving(harness):
        errors = []
        worker = threading.Thread(target=lambda: errors.extend(run_workers([trainer])), daemon=True)
        worker.start()
        # the second forward now waits
        wait_for(lambda: trainer.member.records, 30, "the first step")
        assert len(link_threads(trainer)) == 2
        stopped_at = time.monotonic()
        trainer.member.stop_requested.set()
        worker.join(timeout=JOIN_S)
    assert not worker.is_alive()
    assert time.monotonic() - stopped_at < 10.0  # waits poll the stop flag every 0.1 s
    assert len(errors) == 1 and isinstance(errors[0], Aborted)
    assert not link_threads(trainer)


def test_unanswered_overlapped_pull_times_out(harnesses):
    trainer, harness = blocked_worker(harnesses, ["cluster.request_timeout_s=1.0"])
    with serving(harness):
        started = time.monotonic()
        (error,) = run_workers([trainer])
    assert isinstance(error, RequestTimeout), error
    assert time.monotonic() - started < 30 and not link_threads(trainer)


def test_overlap_applies_to_gradient_loops_only():
    on = ["comm.overlap=true"]
    assert trainer_class(load_config(None, ["algorithm.name=sync"])) is Trainer
    assert trainer_class(load_config(None, ["algorithm.name=async", *on])) is OverlapTrainer
    assert trainer_class(load_config(None, ["algorithm.name=cpsgd", *on])) is LocalSgdTrainer
