"""`optimizer.clip_grad_norm`: a worker scales its gradient to at most that
L2 norm (over every parameter) before the push, and before each local step
of the model-averaging loops; the step records carry the norm before
clipping. Real forward/backward on real models; the pushed tensors are
what `ModelState.outgoing` hands the client."""

from __future__ import annotations

import pytest
import torch
from test_overlap import make_trainers, one_thread, setup  # noqa: F401  (one_thread: an autouse fixture)

from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics
from hetps.sim.engine import simulate
from hetps.training.data import load_datasets

# its shard parts are flat on the worker
LENET = ("model.name=lenet5", "data.synthetic.shape=[1,28,28]")


def first_gradients(harnesses, *overrides) -> tuple[dict[str, torch.Tensor], object]:
    """One worker's first forward/backward; the gradients it would push, and the trainer."""
    cfg, data, _, plan = setup(harnesses, list(overrides), 2)
    trainer = make_trainers(cfg, data, plan, 1)[0]
    try:
        trainer.compute()
        pushed = trainer.state.outgoing()
        grads = {
            n: pushed[n].clone()
            for n, (_, kind) in trainer.state.tensors.items()
            if kind == "param"
        }
    finally:
        trainer.client.close()
    return grads, trainer


def norm(grads: dict[str, torch.Tensor]) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    )


@pytest.mark.parametrize("model", [(), LENET], ids=["resnet20", "lenet5-flat"])
def test_the_pushed_gradient_is_the_raw_one_scaled_to_the_norm(harnesses, model):
    raw, plain = first_gradients(harnesses, *model)
    max_norm = norm(raw) / 4
    clipped, trainer = first_gradients(harnesses, *model, f"optimizer.clip_grad_norm={max_norm}")
    assert plain.work.grad_norm is None and plain.work.norm_record() == {}
    # the norm before clipping, recorded
    assert trainer.work.grad_norm == pytest.approx(norm(raw), rel=1e-5)
    assert norm(clipped) == pytest.approx(max_norm, rel=1e-5)
    for name, g in raw.items():
        torch.testing.assert_close(clipped[name], g * (max_norm / norm(raw)), rtol=1e-5, atol=1e-8)
    if model:  # the flat layout: what the push sends is the clipped gradient buffer itself
        assert trainer.state.flat is not None and trainer.state.flat.parts
        flat = torch.cat([p.grads for p in trainer.state.flat.parts])
        assert float(torch.linalg.vector_norm(flat)) == pytest.approx(max_norm, rel=1e-5)
    # a bound above the norm leaves the gradient exactly as it was
    loose, _ = first_gradients(harnesses, *model, f"optimizer.clip_grad_norm={norm(raw) * 10}")
    assert all(torch.equal(loose[n], raw[n]) for n in raw)


def test_a_non_finite_gradient_is_left_to_the_shards_nonfinite_policy(harnesses):
    """Scaling by max_norm / inf would zero every finite entry: the gradient stays
    as it was (the shard refuses, skips or clips it), its norm recorded as null."""
    cfg, data, _, plan = setup(harnesses, ["optimizer.clip_grad_norm=0.001"], 2)
    trainer = make_trainers(cfg, data, plan, 1)[0]
    try:
        trainer.compute()
        name, (weight, _) = next(iter(trainer.state.tensors.items()))
        weight.grad.view(-1)[0] = float("inf")
        before = {
            n: t.grad.clone() for n, (t, kind) in trainer.state.tensors.items() if kind == "param"
        }
        trainer.work.clip_gradients()
        assert all(
            torch.equal(t.grad, before[n])
            for n, (t, kind) in trainer.state.tensors.items()
            if kind == "param"
        )
        assert trainer.work.norm_record() == {"grad_norm": None}
    finally:
        trainer.client.close()


def test_bad_clip_settings_name_the_key():
    with pytest.raises(ConfigError) as neg:
        load_config(None, ["optimizer.clip_grad_norm=-1"])
    assert "optimizer.clip_grad_norm: must be >= 0" in str(neg.value)
    with pytest.raises(ConfigError) as overlap:
        load_config(
            None, ["optimizer.clip_grad_norm=1", "comm.overlap=true", "algorithm.name=sync"]
        )
    assert "optimizer.clip_grad_norm: needs the whole gradient before the push" in str(
        overlap.value
    )
    # model averaging has no push during the backward: overlap does not apply, clipping does
    assert (
        load_config(
            None, ["optimizer.clip_grad_norm=1", "comm.overlap=true", "algorithm.name=cpsgd"]
        ).optimizer.clip_grad_norm
        == 1.0
    )


@pytest.mark.parametrize("algorithm", ["sync", "cpsgd", "diloco"])
def test_a_simulated_run_with_clipping_trains_and_records_the_norms(tmp_path, algorithm):
    cfg = load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            "optimizer.clip_grad_norm=0.5",
            "data.batch_size=16",
            "eval.every_s=0.25",
            "stop.target_accuracy=null",
            "stop.max_seconds=1.5",
            "cluster.workers=[{slowdown: 1}, {slowdown: 2}]",
            "sim.sample_s=0.0005",
        ],
    )
    summary = simulate(cfg, tmp_path / "run", data=load_datasets(cfg.data, cfg.seed))
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    assert steps and all(r["grad_norm"] > 0 for r in steps)
    assert any(r["grad_norm"] > 0.5 for r in steps)  # the bound was met, so clipping acted
    assert summary["final_accuracy"] > 0.5, summary["final_accuracy"]  # it trained (chance: 0.1)
