"""groups.png stays readable at many updates (issue 42): past TICKS_UP_TO updates a lane, a
tick per update ran into one solid bar per group, so the plot shows each group's updates per
second over time instead. Drawn from a real (simulated) Grouping-SGD run of two groups of
unequal speed, as `hetps simulate` writes it."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from cluster_util import REPO

from hetps.frontend.cli import main as hetps_main
from hetps.frontend.plots import TICKS_UP_TO, group_lanes, group_rates, plot_groups
from hetps.frontend.sample_cost import LENET5_SAMPLE_S
from hetps.scheduler.runlog import read_metrics


@pytest.fixture(scope="module")
def grouping_run(tmp_path_factory):
    """configs/default.yaml (workers [1, 1, 3, 3]: two groups) for 1200 steps in virtual time at
    LeNet-5's sample_s, by `hetps simulate`'s entry point in this process (no torch import of
    its own)."""
    run_dir = tmp_path_factory.mktemp("groups") / "run"
    code = hetps_main(
        [
            "simulate",
            str(REPO / "configs" / "default.yaml"),
            "stop.target_accuracy=null",
            "stop.max_steps=1200",
            "stop.max_seconds=10000",
            "data.batch_size=4",
            "eval.every_s=50",
            f"sim.sample_s={LENET5_SAMPLE_S}",  # LeNet-5's figure: not measured on this machine
            "--out",
            str(run_dir),
        ]
    )
    assert code == 0
    return run_dir


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_each_groups_rate_adds_up_to_its_updates_and_shows_who_is_faster(grouping_run):
    lanes = group_lanes(read_metrics(grouping_run / "metrics.jsonl"))
    assert len(lanes) == 2 and min(map(len, lanes.values())) > 0, {
        k: len(v) for k, v in lanes.items()
    }
    assert max(map(len, lanes.values())) > TICKS_UP_TO  # too many ticks to tell apart
    edges, rates = group_rates(lanes)
    assert len(edges) - 1 == len(next(iter(rates.values()))) > 10  # a curve, not one number
    widths = np.diff(edges)
    for key, ts in lanes.items():
        assert float((rates[key] * widths).sum()) == pytest.approx(len(ts))
    # workers 0 and 1 are 3x faster than 2 and 3: their group's rate is the higher one all along
    fast, slow = sorted(lanes, key=lambda k: len(lanes[k]), reverse=True)
    inner = slice(1, -1)  # the first and last spans are cut by the run's start and stop
    assert (rates[fast][inner] > rates[slow][inner]).all()


def test_groups_png_at_many_updates_draws_the_rates_without_tick_lanes(grouping_run, tmp_path):
    assert (grouping_run / "groups.png").exists()  # `hetps simulate` drew it
    out = plot_groups(grouping_run)
    # one panel (the rates, 3.2 in at 100 dpi), not lanes of ticks run into bars
    assert png_size(out) == (1100, 320), png_size(out)
    # a few updates a lane: the ticks are drawn below the rates, one lane per group
    few = [
        r
        for r in read_metrics(grouping_run / "metrics.jsonl")
        if r["kind"] != "step" or r["step"] <= 40
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in few))
    assert max(map(len, group_lanes(read_metrics(tmp_path / "metrics.jsonl")).values())) <= 40
    assert png_size(plot_groups(tmp_path))[1] > 320
