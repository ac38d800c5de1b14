"""The algorithm table (hetps.runconfig.algorithms): every line resolves in every
role's registry and runs a round on a real shard; the plan carries the
resolved parameters; shards and workers refuse a plan whose algorithm
differs from their own config, naming both values (a worker daemon's refusal:
tests/cluster/test_cluster_algorithm_mismatch.py)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from cluster_util import REPO
from shard_harness import ShardHarness, grads, make_plan, tiny_model, values_of

from hetps.proto.codec import Envelope
from hetps.proto.messages import Params, Pull, Register
from hetps.proto.plan import TensorSpec
from hetps.proto.transport import MemServer, make_server
from hetps.ps.policies import POLICIES, ConsistencyPolicy
from hetps.ps.policies.averaging import ModelAveragingPolicy
from hetps.ps.shard import NEUTRAL_PUSH, Shard
from hetps.runconfig.algorithms import (
    ALGORITHMS,
    AlgorithmMismatch,
    algorithm,
    check_plan_algorithm,
    resolved_params,
)
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.coordinator import Coordinator
from hetps.scheduler.formation import FORMATIONS
from hetps.training.state import model_specs
from hetps.training.step import PERIODS, Period
from hetps.worker.lifecycle import WORKER_LOOPS, trainer_class
from hetps.worker.local import LocalSgdTrainer
from hetps.worker.overlap import OverlapTrainer

A, B = 11, 12  # worker node ids


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_table_line_resolves_in_every_role(name):
    algo = ALGORITHMS[name]
    cfg = load_config(None, [f"algorithm.name={name}"])
    assert type(cfg.algorithm.params) is algo.params and dataclasses.is_dataclass(algo.params)
    # shard
    assert issubclass(POLICIES[algo.policy], ConsistencyPolicy)
    assert (algo.pushes == "model") == issubclass(POLICIES[algo.policy], ModelAveragingPolicy)
    assert algo.pushes in NEUTRAL_PUSH
    # scheduler
    formation = FORMATIONS[algo.groups]
    fields = formation.plan_fields({1: 10.0, 2: 10.0, 3: 1.0}, cfg.algorithm.params)
    assert sorted(w for g in fields["groups"] for w in g) == [1, 2, 3]
    assert formation.regroups == (algo.groups in ("by_speed", "balanced"))
    # worker
    loop = WORKER_LOOPS[algo.worker_loop]
    assert trainer_class(cfg) is loop
    overlapped = trainer_class(load_config(None, [f"algorithm.name={name}", "comm.overlap=true"]))
    assert overlapped is (OverlapTrainer if algo.worker_loop == "gradients" else loop)
    if algo.worker_loop == "local_steps":
        # models wait whole rounds: acked at once
        assert not algo.fuses_pull and algo.pushes == "model"
        assert isinstance(PERIODS[algo.period](cfg.algorithm.params), Period)
    # local steps, then start - end: compressed like gradients
    elif algo.worker_loop == "pseudo_gradients":
        assert issubclass(loop, LocalSgdTrainer) and algo.pushes == "gradients"
        assert isinstance(PERIODS[algo.period](cfg.algorithm.params), Period)
    else:
        assert algo.period == "" and algo.pushes == "gradients"


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_table_line_closes_a_round_on_a_shard(name):
    """Two workers push once each with the algorithm's default parameters; the
    pull after both pushes gets new values (every policy has applied by then)."""
    model = tiny_model()
    h = ShardHarness(model_specs(model), [], [A, B], algorithm=name)
    try:
        before = values_of(model)
        h.init(before)
        for node in (A, B):
            h.push(node, 0, grads(model, node), base_version=0)
        req = h.client(A).send(Pull(plan_id=h.plan_id, clock=1))
        h.serve()
        reply = h.client(A).wait(req, timeout_s=5.0)
        assert isinstance(reply, Params) and reply.version >= 1
        assert not torch.equal(reply.tensors["0.weight"], before["0.weight"])
    finally:
        h.close()


def test_unknown_name_is_a_config_error_naming_the_allowed_ones():
    with pytest.raises(
        ConfigError, match="algorithm.name: unknown value 'nope'; allowed: sync, async"
    ):
        algorithm("nope")


def test_the_plan_carries_the_resolved_parameters(tmp_path):
    cfg = load_config(
        None,
        ["algorithm.name=ssp", "algorithm.staleness=5", "cluster.workers=1", "cluster.shards=1"],
    )
    server = MemServer("mem://table-coordinator")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        for role in ("ps", "worker"):
            msg = Register(
                role=role,
                rank=0,
                address="mem://ps0" if role == "ps" else "",
                speed=1.0,
                tensor_specs=[TensorSpec("w", "float32", (2,))] if role == "worker" else [],
            )
            coord.on_register(b"peer", Envelope(msg, req_id=1, src=0))
        plan = coord.plan
    finally:
        server.close()
    resolved = {"staleness": 5, "scale_lr": False, "lr_share": False, "delay_compensation": 0.0}
    assert (plan.algorithm, plan.algorithm_params) == ("ssp", resolved)
    # it travels in PLAN messages
    assert plan.to_dict()["algorithm_params"] == resolved


def plan_for(overrides: list[str]):
    cfg = load_config(None, overrides)
    specs = model_specs(tiny_model())
    plan = make_plan(specs, [A, B], algorithm=cfg.algorithm.name)
    return dataclasses.replace(plan, algorithm_params=resolved_params(cfg.algorithm))


def test_the_plans_parameters_survive_the_wire():
    """A node checks the plan it decoded: the resolved parameters must cross the codec intact."""
    from hetps.proto.codec import decode, encode
    from hetps.proto.messages import Plan

    plan = plan_for(["algorithm.name=ssp", "algorithm.staleness=2"])
    received = decode(encode(Plan(plan_id=plan.plan_id, plan=plan))).msg.plan
    assert (
        received.algorithm_params == plan.algorithm_params
        and received.algorithm_params["staleness"] == 2
    )
    with pytest.raises(AlgorithmMismatch, match="staleness"):
        check_plan_algorithm(
            load_config(None, ["algorithm.name=ssp", "algorithm.staleness=3"]).algorithm, received
        )


def test_check_refuses_another_parameter_naming_both_values():
    plan = plan_for(["algorithm.name=ssp", "algorithm.staleness=2"])
    mine = load_config(None, ["algorithm.name=ssp", "algorithm.staleness=3"]).algorithm
    with pytest.raises(
        AlgorithmMismatch,
        match=r"in staleness: this node's config says \{staleness: 3\}, "
        r"the plan \(the scheduler's config\) says \{staleness: 2\}",
    ):
        check_plan_algorithm(mine, plan)
    # equal: accepted
    check_plan_algorithm(load_config(None, ["algorithm.name=ssp"]).algorithm, plan)


def test_check_refuses_another_algorithm_even_without_parameters_in_the_plan():
    # a hand-built plan
    plan = dataclasses.replace(plan_for(["algorithm.name=sync"]), algorithm_params={})
    with pytest.raises(
        AlgorithmMismatch, match=r"name: this node's config says \{[^}]*name: 'async'"
    ):
        check_plan_algorithm(load_config(None, ["algorithm.name=async"]).algorithm, plan)
    check_plan_algorithm(load_config(None, ["algorithm.name=sync"]).algorithm, plan)


def test_a_shard_refuses_a_plan_with_other_parameters():
    plan = plan_for(["algorithm.name=grouping", "algorithm.scale_lr=true"])
    cfg = load_config(None, ["algorithm.name=grouping", "algorithm.scale_lr=false"])
    server = make_server("mem://table-shard-refuses")
    try:
        with pytest.raises(
            AlgorithmMismatch, match="scale_lr: this node's config says {scale_lr: False}"
        ):
            Shard(server, plan.shards[0].node_id, plan, cfg)
    finally:
        server.close()


def test_the_table_imports_no_role():
    """proto is the contract: the table names policies, loops and formations by string only."""
    probe = (
        "import sys, hetps.runconfig.algorithms; "
        "print(sorted(m for m in sys.modules if m.startswith(('hetps.ps', 'hetps.worker', 'hetps.scheduler'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_no_role_compares_an_algorithm_name():
    """Behaviour follows the table's traits: a comparison with an algorithm's
    name in role code (`== "grouping"`, `in ("async", "ssp")`) is a branch the
    table should carry instead."""
    names = "|".join(ALGORITHMS)
    branch = re.compile(rf"""(?:[=!]=|\bin)\s*[(\[{{]?\s*["']({names})["']""")
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for folder in ("proto", "ps", "worker", "scheduler")
        for path in sorted((REPO / folder).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []
