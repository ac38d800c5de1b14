"""The address a shard registers when it binds every interface: this host's
address on the route to the scheduler, so peers on other hosts can connect
(tests/cluster/test_netns.py runs it across namespaces)."""

from __future__ import annotations

import pytest

from hetps.runtime.membership import reachable


@pytest.mark.parametrize("bound", ["tcp://0.0.0.0:7100", "tcp://*:7100"])
def test_a_wildcard_bind_names_the_interface_toward_the_scheduler(bound):
    assert reachable(bound, "tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7100"


@pytest.mark.parametrize("bound", ["tcp://10.0.0.5:7100", "ipc:///tmp/ps0", "tcp://ps0:7100"])
def test_a_named_address_is_registered_as_bound(bound):
    assert reachable(bound, "tcp://127.0.0.1:7000") == bound


def test_without_a_tcp_scheduler_or_a_route_the_bound_address_stays(caplog):
    assert reachable("tcp://0.0.0.0:7100", "ipc:///run/hetps/scheduler") == "tcp://0.0.0.0:7100"
    assert reachable("tcp://0.0.0.0:7100", "tcp://[::1]:7000") == "tcp://0.0.0.0:7100"
    assert "pass --advertise" in caplog.text
