"""Sparse tables through checkpoint files, in one process: three real Shards
(mem:// transports) train rows, write their checkpoints with the shards'
Checkpointer; a fresh Shard of the same plan restored from its file holds
the same slices, optimizer state, steps, open rounds and last row ACK per
worker (a push re-sent after the restart is answered, not applied again);
a resumed run (new workers) applies the old workers' open round; and
`hetps export`'s reading of the checkpoints (newest_tensors) joins the three
slices into the whole table."""

from __future__ import annotations

import dataclasses
import uuid

import torch
from shard_harness import SHARD_IDS, make_plan, tiny_model, values_of

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Ack, Init, PushRows
from hetps.proto.plan import NodeEntry, TensorSpec
from hetps.proto.transport import make_client, make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.runtime import checkpoint
from hetps.scheduler.placement import place
from hetps.training.export import newest_tensors
from hetps.training.state import model_specs

A, B = 11, 12
ROWS, DIM = 301, 3  # not a multiple of 3 shards: slices of 101, 100, 100 rows
TABLE = "emb.weight"
SHARDS = (*SHARD_IDS, 23)


def config(algorithm: str):
    return load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            "sparse.tables=[emb]",
            "sparse.optimizer.name=adam",
            "sparse.optimizer.lr=0.05",
            "sparse.init_std=0.5",
        ],
    )


class Shards:
    def __init__(self, algorithm: str):
        self.cfg = config(algorithm)
        model = tiny_model()
        tag = uuid.uuid4().hex[:10]
        plan = make_plan(model_specs(model), [A, B], n_shards=2, algorithm=algorithm)
        self.plan = dataclasses.replace(
            plan,
            shards=[NodeEntry(s, i, f"mem://spck-{tag}-{i}") for i, s in enumerate(SHARDS)],
            placement=place(plan.tensors, [1.0] * 3),
            tables=[TensorSpec(TABLE, "float32", (ROWS, DIM), "table")],
        )
        self.shards = [self.make(i) for i in range(3)]
        values = values_of(model)
        for i in range(3):
            owned = {t.name: values[t.name] for t in self.plan.owned(i)}
            assert isinstance(
                self.call(i, Init(plan_id=self.plan.plan_id, tensors=owned), 1, A), Ack
            )

    def make(self, i: int) -> Shard:
        return Shard(make_server(self.plan.shards[i].address), SHARDS[i], self.plan, self.cfg)

    def call(self, i: int, msg, req_id: int, src: int):
        client = make_client(self.plan.shards[i].address)
        client.send(encode(msg, req_id, src))
        while self.shards[i].serve_once(0.0):
            pass
        frames = client.recv(5.0)
        client.close()
        return decode(frames).msg

    def push(self, node: int, clock: int, ids: list[int], req_id: int) -> None:
        """One step's row push of `node` to every shard (its rows of `ids`)."""
        g = torch.Generator().manual_seed(req_id)
        for i in range(3):
            mine = torch.tensor([x for x in ids if x % 3 == i], dtype=torch.int64)
            msg = PushRows(
                plan_id=self.plan.plan_id,
                clock=clock,
                n_samples=4,
                tensors={
                    f"{TABLE}:ids": mine,
                    f"{TABLE}:rows": torch.randn(mine.numel(), DIM, generator=g),
                },
            )
            assert isinstance(self.call(i, msg, req_id, node), Ack)

    def close(self) -> None:
        for s in self.shards:
            s.server.close()


def write_checkpoints(shards: Shards, root) -> list:
    paths = []
    for i, s in enumerate(shards.shards):
        folder = checkpoint.shard_dir(root, shards.plan.run_id, i)
        folder.mkdir(parents=True, exist_ok=True)
        paths.append(checkpoint.Checkpointer(shards.cfg.checkpoint, folder).write(s.state_dict()))
    return paths


def same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_restored_shard_holds_its_slices_and_dedupes_a_resent_push(tmp_path):
    shards = Shards("sync")
    try:
        shards.push(A, 0, [0, 1, 2, 5, 300], req_id=7)
        shards.push(B, 0, [0, 3, 4, 5], req_id=8)  # the round closes
        shards.push(A, 1, [1, 2, 6], req_id=9)  # A's next round is open at the checkpoint
        paths = write_checkpoints(shards, tmp_path)
        for i, path in enumerate(paths):
            before = shards.shards[i]
            before.server.close()
            restored = shards.make(i)
            restored.restore(checkpoint.load(path))
            shards.shards[i] = restored
            same(restored.sparse.state_dict(), before.sparse.state_dict())
            assert restored.sparse.rounds and restored.sparse.waiting(A)
            assert restored.rows.recent_acks.by_worker == before.rows.recent_acks.by_worker
        updates = [s.sparse.updates for s in shards.shards]
        assert updates == [1, 1, 1]
        shards.push(A, 1, [1, 2, 6], req_id=9)  # re-sent after the restart: answered only
        assert [s.sparse.updates for s in shards.shards] == updates
        assert all(s.counts["retried"] == 1 for s in shards.shards)
        shards.push(B, 1, [7], req_id=10)  # B closes the restored round
        assert [s.sparse.updates for s in shards.shards] == [2, 2, 2]
    finally:
        shards.close()


def test_a_resumed_run_applies_the_old_workers_open_round(tmp_path):
    shards = Shards("sync")
    try:
        initial = shards.shards[0].sparse.table(TABLE).weight.clone()
        shards.push(A, 0, [0, 1, 2], req_id=7)  # B never pushes: the round stays open
        assert torch.equal(shards.shards[0].sparse.table(TABLE).weight, initial)
        path = write_checkpoints(shards, tmp_path)[0]
        shards.shards[0].server.close()
        resumed = shards.make(0)
        resumed.restore(checkpoint.load(path), new_workers=True)
        shards.shards[0] = resumed
        assert not resumed.sparse.rounds and resumed.sparse.updates == 1
        assert resumed.rows.recent_acks.by_worker == {}
        # A's push alone was applied (a round of one): its rows 0 (and only those) moved
        changed = (resumed.sparse.table(TABLE).weight != initial).any(dim=1).nonzero().flatten()
        assert changed.tolist() == [0]  # global row 0 is shard 0's local row 0
    finally:
        shards.close()


def test_export_joins_three_shards_slices_into_the_whole_table(tmp_path):
    shards = Shards("async")
    try:
        shards.push(A, 0, [0, 1, 2, 5, 300], req_id=7)
        shards.push(B, 0, [0, 3, 4, 299], req_id=8)
        write_checkpoints(shards, tmp_path)
        folders = [checkpoint.shard_dir(tmp_path, shards.plan.run_id, i) for i in range(3)]
        tensors, _ = newest_tensors(folders)
        whole = tensors[TABLE]
        assert whole.shape == (ROWS, DIM)
        for row in (0, 1, 2, 3, 100, 299, 300):
            s = shards.shards[row % 3]
            assert torch.equal(whole[row], s.sparse.rows(TABLE, torch.tensor([row]))[0]), row
        every = torch.arange(ROWS)
        expected = torch.empty(ROWS, DIM)
        for i, s in enumerate(shards.shards):
            expected[i::3] = s.sparse.rows(TABLE, every[i::3])
        assert torch.equal(whole, expected)
    finally:
        shards.close()
