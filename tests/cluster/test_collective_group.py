"""worker/collective_group.py on real processes: two spawned members sum a
tensor through a gloo group built from a TCPStore (random port, served by
this process) and a PrefixStore, as bench/collective.py and the group
aggregation of issue 40 build it; and a member whose peer never joins fails
within the group's timeout instead of hanging."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hetps.worker.collective_group import CollectiveError, gloo_group, open_store

pytestmark = pytest.mark.cluster  # real processes

TIMEOUT_S = 30


def member(port: int, rank: int, size: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    group = gloo_group("127.0.0.1", port, "plan1/group0", rank, size, TIMEOUT_S)
    try:
        tensor = torch.arange(256, dtype=torch.float32) * (rank + 1)  # 1 KB
        results.put((rank, group.allreduce_sum(tensor).tolist()))
    finally:
        group.close()


def test_two_spawned_members_all_reduce_to_the_sum():
    store = open_store("127.0.0.1", 0, is_owner=True, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=member, args=(store.port, r, 2, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(
            results.get(timeout=120) for _ in procs
        )  # a spawn imports torch: slow on 2 cores
        for p in procs:
            p.join(timeout=TIMEOUT_S)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    expected = (torch.arange(256, dtype=torch.float32) * 3).tolist()
    assert got == {0: expected, 1: expected}


def test_a_member_whose_peer_never_joins_fails_within_the_timeout():
    store = open_store("127.0.0.1", 0, is_owner=True, timeout_s=2)
    with pytest.raises(CollectiveError, match="plan1/lonely"):
        gloo_group("127.0.0.1", store.port, "plan1/lonely", 0, 2, 2)


def test_a_bad_rank_or_an_owner_without_a_port_is_refused():
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        gloo_group("127.0.0.1", 1, "g", 2, 2, 1)
    with pytest.raises(ValueError, match="known port"):
        gloo_group("127.0.0.1", 0, "g", 0, 1, 1, is_store_owner=True)
