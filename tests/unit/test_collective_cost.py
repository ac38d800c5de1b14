"""The simulator's charge for a group's all-reduce (sim/costs.py, issue 40):
the ring model's values, and the members' links it is charged on. The real
gloo group it was calibrated with is tested on processes in
tests/cluster/test_collective_group.py."""

from __future__ import annotations

import pytest

from hetps.sim.costs import GLOO_BYTES_PER_S, GLOO_HOP_S, allreduce_s, group_allreduce_s
from hetps.sim.events import Link

MB = 1 << 20


def test_one_member_reduces_nothing():
    assert allreduce_s(64 * MB, 1, 1e9, 1e-3) == 0.0
    assert group_allreduce_s(64 * MB, [Link(mbps=1.0, latency_s=1.0)]) == 0.0


def test_two_members_send_the_bytes_once_and_pay_two_hops():
    # reduce-scatter sends half, all-gather the other half: the bytes once, one hop each
    assert allreduce_s(MB, 2, 1e9, 1e-4) == pytest.approx(MB / 1e9 + 2 * 1e-4)


@pytest.mark.parametrize("k", [2, 3, 4, 8, 64])
def test_bytes_grow_as_2_k_minus_1_over_k_and_hops_as_2_k_minus_1(k):
    bytes_part = allreduce_s(MB, k, 1e9, 0.0)
    assert bytes_part == pytest.approx(2 * (k - 1) / k * MB / 1e9)
    assert bytes_part < 2 * MB / 1e9  # bounded: a ring never sends more than twice the bytes
    assert allreduce_s(0, k, 1e9, 1e-4) == pytest.approx(2 * (k - 1) * 1e-4)


def test_the_defaults_are_the_calibration():
    assert allreduce_s(MB, 4) == allreduce_s(MB, 4, GLOO_BYTES_PER_S, GLOO_HOP_S)
    assert GLOO_BYTES_PER_S > 0 and GLOO_HOP_S >= 0


def test_a_group_goes_at_its_slowest_members_link_and_latencies():
    fast, slow = Link(mbps=0.0, latency_s=0.001), Link(mbps=80.0, latency_s=0.005)
    charged = group_allreduce_s(10 * MB, [fast, fast, slow])
    # 80 Mbit/s = 1e7 bytes/s, far under gloo's own rate; a hop crosses the two slowest links
    assert charged == pytest.approx(allreduce_s(10 * MB, 3, 1e7, GLOO_HOP_S + 0.005 + 0.001))
    assert slow.up_free == 0.0 and slow.down_free == 0.0  # pure: the links' queues stay put


def test_uncapped_links_go_at_gloos_rate():
    assert group_allreduce_s(MB, [Link(), Link()]) == pytest.approx(allreduce_s(MB, 2))
