"""`model.autocast: bfloat16`: training forward passes run under
torch.autocast; parameters, gradients, what is pushed and the shards stay
float32. Real models, real forward/backward (CPU autocast here; the same
context on CUDA)."""

from __future__ import annotations

import pytest
import torch
from test_overlap import make_trainers, one_thread, setup  # noqa: F401  (one_thread: an autouse fixture)

from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics
from hetps.sim.engine import simulate
from hetps.training.data import load_datasets


def first_step(harnesses, *overrides) -> tuple[float, dict[str, torch.Tensor]]:
    """One worker's first forward/backward (resnet20, with BatchNorm): its loss and what it would push."""
    cfg, data, _, plan = setup(harnesses, list(overrides), 1)
    trainer = make_trainers(cfg, data, plan, 1)[0]
    try:
        loss = trainer.compute()
        return loss, {n: t.clone() for n, t in trainer.state.outgoing().items()}
    finally:
        trainer.client.close()


def test_a_bfloat16_forward_pushes_float32_gradients_close_to_float32s(harnesses):
    loss32, push32 = first_step(harnesses)
    loss16, push16 = first_step(harnesses, "model.autocast=bfloat16")
    # it did run in lower precision
    assert loss16 == pytest.approx(loss32, rel=0.05) and loss16 != loss32
    assert push16.keys() == push32.keys()
    # float32 (and BN's int64 counter)
    assert all(t.dtype == push32[n].dtype for n, t in push16.items())
    grads = [n for n, t in push32.items() if t.dtype == torch.float32 and float(t.norm()) > 0]
    g16 = torch.cat([push16[n].flatten() for n in grads])
    g32 = torch.cat([push32[n].flatten() for n in grads])
    assert float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)) > 0.98


def test_an_unknown_autocast_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["model.autocast=float8"])
    assert "model.autocast" in str(bad.value) and "bfloat16" in str(bad.value)


def test_a_simulated_run_under_bfloat16_autocast_trains(tmp_path):
    cfg = load_config(
        None,
        [
            "algorithm.name=sync",
            "model.autocast=bfloat16",
            "data.batch_size=16",
            "eval.every_s=0.25",
            "stop.target_accuracy=null",
            "stop.max_seconds=1.5",
            "cluster.workers=[{slowdown: 1}, {slowdown: 2}]",
            "sim.sample_s=0.0005",
        ],
    )
    summary = simulate(cfg, tmp_path / "run", data=load_datasets(cfg.data, cfg.seed))
    assert any(r["kind"] == "step" for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert summary["final_accuracy"] > 0.5, summary["final_accuracy"]  # it trained (chance: 0.1)
