"""The experiment configuration: defaults, YAML, overrides, strict errors, round trip."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import yaml

from hetps.runconfig.algorithm_params import AsyncParams, SspParams, SyncParams
from hetps.runconfig.algorithms import ALGORITHM_PARAMS
from hetps.runconfig.load import config_from_dict, config_to_dict, dump_config, load_config
from hetps.runconfig.schema import BUILTIN_MODELS, DATASETS, ConfigError, NodeConfig, RunConfig


def write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def error(path=None, overrides=(), raw=None) -> str:
    with pytest.raises(ConfigError) as ei:
        if raw is not None:
            config_from_dict(raw)
        else:
            load_config(path, list(overrides))
    return str(ei.value)


# ------------------------------------------------------------ loading


def test_defaults():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.algorithm.name == "sync"
    assert cfg.algorithm.params == SyncParams()
    assert cfg.model.name == "lenet5"
    assert cfg.data.dataset == "mnist-5k"
    assert len(cfg.cluster.workers) == 4 and len(cfg.cluster.shards) == 2
    assert all(n == NodeConfig() for n in cfg.cluster.workers)
    assert cfg.stop.target_accuracy == 0.95
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg, RunConfig)


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


def test_empty_file_is_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == RunConfig()


def test_yaml_file_and_overrides(tmp_path):
    path = write(
        tmp_path,
        {
            "name": "exp1",
            "seed": 5,
            "model": {"name": "mlp", "kwargs": {"hidden": 64}},
            "data": {
                "dataset": "synthetic",
                "batch_size": 16,
                "synthetic": {"shape": [3, 8, 8], "classes": 4},
            },
            "optimizer": {
                "name": "adam",
                "lr": 1,
                "schedule": {"name": "cosine", "total_steps": 100},
            },
            "cluster": {"workers": [{"slowdown": 2}, {}, {"threads": 2}]},
            "stop": {"target_accuracy": None, "max_seconds": 10},
        },
    )
    cfg = load_config(
        path,
        [
            "data.batch_size=64",
            "cluster.workers.1.slowdown=3",
            "algorithm.name=ssp",
            "algorithm.staleness=3",
            "eval.enabled=false",
            "cluster.shards=1",
        ],
    )
    assert cfg.name == "exp1" and cfg.seed == 5
    assert cfg.model.name == "mlp" and cfg.model.kwargs == {"hidden": 64}
    assert cfg.data.dataset == "synthetic"
    assert cfg.data.batch_size == 64  # override beats the file
    assert cfg.data.synthetic.shape == [3, 8, 8] and cfg.data.synthetic.classes == 4
    assert cfg.data.synthetic.train_size == 4096  # untouched default
    assert cfg.optimizer.name == "adam"
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int accepted for float
    assert cfg.optimizer.schedule.total_steps == 100
    assert [w.slowdown for w in cfg.cluster.workers] == [2.0, 3.0, 1.0]
    assert cfg.cluster.workers[2].threads == 2
    assert len(cfg.cluster.shards) == 1
    assert cfg.algorithm.name == "ssp" and cfg.algorithm.params == SspParams(staleness=3)
    assert cfg.eval.enabled is False
    assert cfg.stop.target_accuracy is None and cfg.stop.max_seconds == 10.0


def test_workers_shorthand():
    cfg = load_config(None, ["cluster.workers=2"])
    assert cfg.cluster.workers == [NodeConfig(), NodeConfig()]
    cfg = load_config(None, ["cluster.workers=2", "cluster.workers.1.slowdown=3"])
    assert [w.slowdown for w in cfg.cluster.workers] == [1.0, 3.0]


def test_workers_shorthand_in_file(tmp_path):
    cfg = load_config(write(tmp_path, {"cluster": {"workers": 3, "shards": 1}}))
    assert len(cfg.cluster.workers) == 3 and len(cfg.cluster.shards) == 1


def test_list_index_override_on_default_workers():
    cfg = load_config(None, ["cluster.workers.3.slowdown=4", "cluster.shards.0.threads=2"])
    assert [w.slowdown for w in cfg.cluster.workers] == [1.0, 1.0, 1.0, 4.0]
    assert cfg.cluster.shards[0].threads == 2


def test_algorithm_overrides():
    cfg = load_config(None, ["algorithm.name=ssp"])
    assert cfg.algorithm.params == SspParams()
    cfg = load_config(None, ["algorithm.name=ssp", "algorithm.staleness=3"])
    assert cfg.algorithm.params.staleness == 3
    assert load_config(None, ["algorithm.name=async"]).algorithm.params == AsyncParams()


def test_override_values_are_yaml():
    cfg = load_config(None, ["optimizer.betas=[0.8, 0.9]", "model.kwargs={depth: 3}", "name="])
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.model.kwargs == {"depth": 3}
    assert cfg.name == ""


# ------------------------------------------------------------ errors


def test_unknown_top_level_key():
    msg = error(overrides=["bogus=1"])
    assert "bogus" in msg
    assert "allowed:" in msg
    for name in (
        "name",
        "seed",
        "model",
        "data",
        "optimizer",
        "algorithm",
        "cluster",
        "stop",
        "eval",
    ):
        assert name in msg


def test_unknown_top_level_key_in_file(tmp_path):
    msg = error(write(tmp_path, {"modle": {"name": "mlp"}}))
    assert "modle" in msg and "model" in msg


def test_unknown_nested_key():
    msg = error(overrides=["data.bogus=1"])
    assert "data.bogus" in msg
    for name in ("dataset", "batch_size", "eval_batch_size", "root", "download", "synthetic"):
        assert name in msg


def test_unknown_deeply_nested_key():
    msg = error(overrides=["optimizer.schedule.lenght=3"])
    assert "optimizer.schedule.lenght" in msg
    assert "total_steps" in msg and "warmup_steps" in msg


def test_unknown_node_key():
    msg = error(overrides=["cluster.workers.1.speed=3"])
    assert "cluster.workers.1.speed" in msg
    assert "slowdown" in msg and "threads" in msg and "device" in msg


@pytest.mark.parametrize(
    "override, path, expected",
    [
        ("data.batch_size=x", "data.batch_size", "int"),
        ("data.batch_size=2.5", "data.batch_size", "int"),
        ("data.batch_size=true", "data.batch_size", "int"),
        ("stop.max_seconds=[1]", "stop.max_seconds", "float"),
        ("eval.enabled=1", "eval.enabled", "bool"),
        ("model.kwargs=[1]", "model.kwargs", "dict"),
        ("data.synthetic.shape=3", "data.synthetic.shape", "list"),
        ("data.synthetic.shape=[1, x]", "data.synthetic.shape.1", "int"),
        ("data=3", "data", "mapping"),
    ],
)
def test_wrong_type(override, path, expected):
    msg = error(overrides=[override])
    assert msg.startswith(path + ":")
    assert expected in msg


def test_unknown_algorithm_name():
    msg = error(overrides=["algorithm.name=hogwild"])
    assert "algorithm.name" in msg and "hogwild" in msg
    for name in ALGORITHM_PARAMS:
        assert name in msg


def test_unknown_algorithm_parameter():
    msg = error(overrides=["algorithm.name=ssp", "algorithm.stalenes=3"])
    assert "algorithm.stalenes" in msg
    assert "staleness" in msg.split("allowed:", 1)[1]
    msg = error(overrides=["algorithm.staleness=3"])  # sync takes no parameters
    assert "algorithm.staleness" in msg and "allowed" in msg


@pytest.fixture
def fake_torchvision(monkeypatch):
    """Importing the real torchvision takes seconds; the check only needs list_models()."""
    models = types.SimpleNamespace(list_models=lambda: ["resnet18", "vit_b_16"])
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))


def test_unknown_model_name(fake_torchvision):
    msg = error(overrides=["model.name=not_a_model_at_all"])
    assert "model.name" in msg and "not_a_model_at_all" in msg
    for name in BUILTIN_MODELS:
        assert name in msg


def test_torchvision_model_name_is_accepted(fake_torchvision):
    assert load_config(None, ["model.name=resnet18"]).model.name == "resnet18"


def test_custom_model_factory_name_is_accepted():
    assert load_config(None, ["model.name=mypkg.models:build"]).model.name == "mypkg.models:build"


def test_unknown_dataset():
    msg = error(overrides=["data.dataset=imagenet-22k"])
    assert "data.dataset" in msg and "imagenet-22k" in msg
    for name in DATASETS:
        assert name in msg


def test_unknown_optimizer():
    msg = error(overrides=["optimizer.name=lamb"])
    assert "optimizer.name" in msg and "lamb" in msg
    assert "sgd" in msg and "adam" in msg


def test_unknown_schedule():
    msg = error(overrides=["optimizer.schedule.name=linear"])
    assert "optimizer.schedule.name" in msg
    for name in ("constant", "step", "cosine"):
        assert name in msg


def test_cosine_needs_total_steps():
    msg = error(overrides=["optimizer.schedule.name=cosine"])
    assert "optimizer.schedule.total_steps" in msg
    cfg = load_config(None, ["optimizer.schedule.name=cosine", "optimizer.schedule.total_steps=10"])
    assert cfg.optimizer.schedule.total_steps == 10


@pytest.mark.parametrize(
    "override, path",
    [
        ("cluster.workers.2.slowdown=0.5", "cluster.workers.2.slowdown"),
        ("cluster.shards.0.slowdown=0", "cluster.shards.0.slowdown"),
    ],
)
def test_slowdown_below_one(override, path):
    assert path in error(overrides=[override])


@pytest.mark.parametrize(
    "override, path",
    [
        ("data.batch_size=0", "data.batch_size"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("stop.max_seconds=0", "stop.max_seconds"),
        ("algorithm.name=ssp,algorithm.staleness=-1", "algorithm.staleness"),
        ("cluster.workers=0", "cluster.workers"),
    ],
)
def test_out_of_range(override, path):
    assert path in error(overrides=override.split(","))


@pytest.mark.parametrize(
    "override, path",
    [
        ("cluster.workers.4.slowdown=2", "cluster.workers.4"),
        ("cluster.workers.x.slowdown=2", "cluster.workers.x"),
        ("seed.x=1", "seed"),
    ],
)
def test_bad_override_paths(override, path):
    assert path in error(overrides=[override])


def test_override_value_that_is_not_yaml():
    assert error(overrides=["cluster.kill=[{node: ps0"]).startswith(
        "cluster.kill: value is not valid YAML"
    )


def test_override_without_equals():
    assert "key=value" in error(overrides=["data.batch_size"])


def test_bad_files(tmp_path):
    assert "cannot read" in error(tmp_path / "missing.yaml")
    assert "not valid YAML" in error(write(tmp_path, "a: [1, 2"))
    assert "mapping" in error(write(tmp_path, "- 1\n- 2\n"))


# ------------------------------------------------------------ round trip


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "algorithm.name=ssp",
            "algorithm.staleness=5",
            "cluster.workers=3",
            "cluster.workers.2.slowdown=2.5",
            "stop.target_accuracy=null",
            "optimizer.schedule.name=cosine",
            "optimizer.schedule.total_steps=50",
            "model.kwargs={width: 8}",
            "data.dataset=synthetic",
            "optimizer.betas=[0.5, 0.75]",
        ],
        ["algorithm.name=async", "model.name=mlp", "eval.enabled=false"],
    ],
)
def test_dump_load_round_trip(tmp_path, overrides):
    cfg = load_config(None, overrides)
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert yaml.safe_load(path.read_text())["algorithm"]["name"] == cfg.algorithm.name


# ------------------------------------------------------------ all errors at once, ranges, algorithms


def test_every_error_is_reported_at_once(tmp_path):
    path = write(
        tmp_path,
        {
            "stop": {"target_accuracy": 95},
            "optimizer": {"momentum": -0.5, "lr": 0},
            "data": {"bogus": 1, "batch_size": "x"},
            "cluster": {"dead_after_s": 0},
        },
    )
    with pytest.raises(ConfigError) as ei:
        load_config(path, ["algorithm.staleness=3", "cluster.workers=[]", "nope.deeper=1"])
    keys = [line.split(":", 1)[0] for line in ei.value.errors]
    assert sorted(keys) == sorted(
        [
            "stop.target_accuracy",
            "optimizer.momentum",
            "optimizer.lr",
            "data.bogus",
            "data.batch_size",
            "cluster.dead_after_s",
            "algorithm.staleness",
            "cluster.workers",
            "nope",
        ]
    )
    assert str(ei.value).count("\n") == len(keys) - 1
    assert "must be in (0, 1]" in str(ei.value) and "got 95.0" in str(ei.value)


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("stop.target_accuracy=95", "stop.target_accuracy", "(0, 1]"),
        ("stop.target_accuracy=0", "stop.target_accuracy", "(0, 1]"),
        ("stop.target_patience=0", "stop.target_patience", ">= 1"),
        ("optimizer.lr=.inf", "optimizer.lr", "finite"),
        ("name=../../elsewhere", "name", "names the run directory"),
        ("cluster.kill=[{node: ps0, at_s: .nan}]", "cluster.kill.0.at_s", "finite"),
        (
            "cluster.workers=[{schedule: [{at_s: .nan, slowdown: 2}]}]",
            "cluster.workers.0.schedule.0",
            "at_s >= 0",
        ),
        ("eval.every_s=1e400", "eval.every_s", "finite"),
        ("cluster.dead_after_s=0", "cluster.dead_after_s", "> 0"),
        ("optimizer.momentum=-0.1", "optimizer.momentum", ">= 0"),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay", ">= 0"),
        ("cluster.workers=[]", "cluster.workers", "at least 1"),
        ("cluster.shards=[]", "cluster.shards", "at least 1"),
        ("cluster.heartbeat_s=6", "cluster.heartbeat_s", "< cluster.dead_after_s"),
        ("cluster.kill=[{node: ps0}]", "cluster.kill.0", "exactly one of at_s"),
        ("cluster.kill=[{node: worker7, at_s: 1}]", "cluster.kill.0.node", "worker3"),
        ("cluster.kill=[{node: ps0, at_s: -1}]", "cluster.kill.0.at_s", ">= 0"),
        ("checkpoint.keep=0", "checkpoint.keep", ">= 1"),
        ("cluster.workers.1.threads=0", "cluster.workers.1.threads", ">= 1"),
        ("cluster.faults.drop=1.5", "cluster.faults.drop", "[0, 1]"),
        ("optimizer.betas=[0.9, 1.0]", "optimizer.betas", "[0, 1)"),
        ("optimizer.momentum=0;optimizer.nesterov=true", "optimizer.nesterov", "momentum > 0"),
        ("data.eval_batch_size=0", "data.eval_batch_size", ">= 1"),
        ("data.resize=[32]", "data.resize", "[height, width]"),
        ("data.kwargs={a: 1}", "data.kwargs", "package.module:factory"),
        ("seed=-1", "seed", ">= 0"),
    ],
)
def test_numbers_out_of_range_name_the_key_and_the_range(override, key, allowed):
    with pytest.raises(ConfigError) as ei:
        load_config(None, override.split(";"))
    assert len(ei.value.errors) == 1, ei.value.errors
    assert ei.value.errors[0].startswith(key + ":") and allowed in ei.value.errors[0]


def test_every_shipped_config_loads():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        load_config(path, import_targets=True)


def test_a_key_of_another_algorithm_says_whose_it_is():
    msg = error(overrides=["algorithm.name=sync", "algorithm.staleness=3"])
    assert msg.startswith("algorithm.staleness: belongs to ssp, not to sync")
    assert error(overrides=["algorithm.name=ssp", "algorithm.period=3"]).startswith(
        "algorithm.period: belongs to cpsgd or diloco, not to ssp"
    )


def test_algorithm_name_on_the_command_line_drops_the_files_algorithm_keys(tmp_path):
    path = write(tmp_path, {"algorithm": {"name": "grouping", "groups": 2, "scale_lr": False}})
    cfg = load_config(path, ["algorithm.name=ssp"])
    assert cfg.algorithm.name == "ssp" and cfg.algorithm.params == SspParams()
    cfg = load_config(path, ["algorithm.name=ssp", "algorithm.staleness=4"])
    assert cfg.algorithm.params == SspParams(staleness=4)
    # what the command line itself set is never dropped silently
    assert error(path, ["algorithm.groups=3", "algorithm.name=ssp"]).startswith(
        "algorithm.groups: belongs to grouping"
    )
    # the same name keeps the file's keys
    assert load_config(path, ["algorithm.name=grouping"]).algorithm.params.groups == 2


def test_factory_targets_are_imported_only_when_asked(tmp_path, monkeypatch):
    (tmp_path / "cfg_targets_mod.py").write_text("def make(**kw):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [
        "model.name=cfg_targets_mod:make",
        "data.dataset=cfg_targets_mod:make",
        "data.kwargs={root: x}",
    ]
    assert load_config(None, overrides, import_targets=True).data.kwargs == {"root": "x"}
    typos = ["model.name=cfg_targets_mdo:make", "data.dataset=cfg_targets_mod:mkae"]
    # the scheduler and shards never import it
    assert load_config(None, typos).model.name == "cfg_targets_mdo:make"
    with pytest.raises(ConfigError) as ei:
        load_config(None, typos, import_targets=True)
    assert [e.split(":", 1)[0] for e in ei.value.errors] == ["model.name", "data.dataset"]
    assert (
        "cannot import 'cfg_targets_mdo'" in ei.value.errors[0]
        and "importable on every host" in ei.value.errors[0]
    )
    assert "no callable 'mkae'" in ei.value.errors[1]


def test_hetps_config_prints_the_resolved_config_or_every_error(tmp_path):
    import subprocess

    from hetps.runconfig.load import config_from_dict

    hetps = [sys.executable, "-m", "hetps.frontend.cli", "config"]
    path = write(
        tmp_path, {"algorithm": {"name": "grouping", "groups": 2}, "data": {"batch_size": 8}}
    )
    out = subprocess.run(
        [*hetps, str(path), "algorithm.name=ssp", "cluster.workers=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    cfg = config_from_dict(yaml.safe_load(out.stdout))
    assert cfg == load_config(path, ["algorithm.name=ssp", "cluster.workers=3"])
    assert (
        cfg.data.batch_size == 8 and len(cfg.cluster.workers) == 3 and cfg.algorithm.name == "ssp"
    )
    bad = subprocess.run(
        [*hetps, str(path), "stop.target_accuracy=95", "cluster.dead_after_s=0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert sorted(line.split(":")[2].strip() for line in bad.stderr.splitlines()) == [
        "cluster.dead_after_s",
        "stop.target_accuracy",
    ]


# ---------------------------------------------------------------- messages a user meets
@pytest.mark.parametrize("value", ["two", "true", "2.5"])
def test_a_node_list_that_is_neither_count_list_nor_mapping_names_every_form(value):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"cluster.workers={value}"])
    (line,) = exc.value.errors
    assert line.startswith("cluster.workers: expected a count (e.g. 4), a list of node settings")
    assert "a mapping with `count`" in line and "got " in line, line


@pytest.mark.parametrize(
    "override, path, suggestion",
    [
        ("modle.name=mlp", "modle", "model"),  # a top-level section
        ("cluster.wokers=2", "cluster.wokers", "workers"),  # a nested key
        ("optimizer.schedule.nam=step", "optimizer.schedule.nam", "name"),  # two levels down
        ("cluster.workers={cont: 3}", "cluster.workers.cont", "count"),  # the node-list shorthand
        ("algorithm.stalenes=2", "algorithm.stalenes", "staleness"),  # an algorithm's parameter
    ],
)
def test_an_unknown_key_gets_a_did_you_mean(override, path, suggestion):
    overrides = ["algorithm.name=ssp", override] if override.startswith("algorithm") else [override]
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    (line,) = exc.value.errors
    assert line.startswith(f"{path}: unknown key (did you mean {suggestion!r}?); allowed: "), line


def test_an_unknown_key_far_from_every_name_gets_no_suggestion():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["zzz=1"])
    assert exc.value.errors == [
        "zzz: unknown key; allowed: " + ", ".join(f.name for f in dataclasses.fields(RunConfig))
    ]
