"""A newcomer's first hour (issue 42), through the `hetps` command as a user types it: a
module beside the config (or in the current directory) imports with no PYTHONPATH; a
custom task's primary metric is watched, the 0.95 accuracy default only for a task whose
primary metric is accuracy; `hetps config` refuses, exit 2 and one line each, what needs
only the config, the task and the model: metric names, sparse-table choices, factories'
keywords, a built-in schedule's key beside a factory, a node list of bare numbers; a
factory name with no close match lists the module's own callables. On real processes
(the daemons import the module too; the check's log is clean): tests/cluster/test_cluster_newcomer.py.

One test runs the console script a user types (a fresh interpreter, no PYTHONPATH); the others
call the entry point it calls (`hetps.frontend.cli.main`, the worker's `main` that `hetps
worker` hands over to) in this process, from the same folder with PYTHONPATH unset and the
import path restored afterwards: the same argv, output and exit status, without a torch import
per command."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from inprocess_cli import run_entry_point
from newcomer_module import MYTASK, SINE_YAML

import hetps
from hetps.runconfig.load import config_to_dict, load_config
from hetps.training.task import load_task, watched_metric

HETPS = Path(sys.executable).with_name("hetps")  # the console script a user runs


@pytest.fixture
def project(tmp_path) -> Iterator[Path]:
    """tmp_path/sine/{mytask.py, sine.yaml}: a user's folder; the tests run from tmp_path."""
    folder = tmp_path / "sine"
    folder.mkdir()
    (folder / "mytask.py").write_text(MYTASK)
    (folder / "sine.yaml").write_text(SINE_YAML)
    yield folder
    sys.modules.pop("mytask", None)  # imported by the tests that load the config here


def hetps_console(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`hetps ARGS` from `cwd`, the console script in a fresh interpreter with no PYTHONPATH: the
    user's modules are found as a user's are."""
    if not HETPS.exists():
        pytest.skip(f"no console script {HETPS} (not an installed environment)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(HETPS), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def hetps_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`hetps ARGS` from `cwd`, with no PYTHONPATH, in this process (support/inprocess_cli.py):
    the entry point the console script calls (`hetps worker`: the worker's own, which it hands
    over to), with nothing of the user's folders on the import path beforehand."""
    from hetps.frontend.cli import main as cli_main
    from hetps.worker.__main__ import main as worker_main

    main = (lambda argv: worker_main(argv[1:])) if args[0] == "worker" else cli_main
    cwd = Path(cwd).absolute()
    # as a fresh `hetps`: neither folder of the user's is on the path until the command puts it
    path = [p for p in sys.path if p not in ("", ".") and Path(p).absolute() != cwd]
    try:
        return run_entry_point(main, list(args), cwd, path, drop_env=("PYTHONPATH",))
    finally:
        if args[0] == "worker":
            faulthandler.unregister(signal.SIGUSR1)  # the worker's (runtime/daemon.py)


def config_errors(project: Path, *overrides: str) -> list[str]:
    """`hetps config sine.yaml OVERRIDES`'s lines, which must be an exit 2."""
    done = hetps_cli("config", str(project / "sine.yaml"), *overrides, cwd=project.parent)
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr.strip().splitlines()


def resolved(project: Path, *overrides: str) -> dict:
    done = hetps_cli("config", str(project / "sine.yaml"), *overrides, cwd=project.parent)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


# ------------------------------------------------------------ 1: modules that import


def test_a_module_beside_the_config_imports_without_pythonpath(project):
    # the console script itself, in a fresh interpreter (the others call its entry point here)
    done = hetps_console("config", str(project / "sine.yaml"), cwd=project.parent)
    assert done.returncode == 0, done.stderr
    cfg = yaml.safe_load(done.stdout)  # run from the folder above: only the config's folder has it
    assert (cfg["task"]["name"], cfg["model"]["name"]) == ("mytask:MacroF1", "mytask:Conv1DNet")


def test_a_module_in_the_current_directory_imports_too(project, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "sine.yaml").write_text(SINE_YAML)
    done = hetps_cli("config", str(configs / "sine.yaml"), cwd=project)
    assert done.returncode == 0, done.stderr


def test_a_daemon_started_by_hand_imports_the_module_beside_its_config(project):
    """`hetps worker --config` on another host (the multi-host path), run from the folder above
    the config with no PYTHONPATH: its --check builds the config's factories, which import."""
    done = hetps_cli(
        "worker", "--config", str(project / "sine.yaml"), "--check", "--rank", "0",
        "--scheduler", "tcp://127.0.0.1:5999", cwd=project.parent,
    )  # fmt: skip
    assert done.returncode == 0 and "hetps worker: ok rank=0" in done.stdout, done.stderr


@pytest.mark.parametrize(
    "command", [["simulate"], ["compare", "--algorithms", "sync,async", "--simulate"]]
)
def test_simulate_and_compare_import_it_too(project, tmp_path, command):
    short = ["stop.max_steps=10", "sim.sample_s=0.00002"]
    out = ["--out", str(tmp_path / "out")]
    done = hetps_cli(
        command[0], str(project / "sine.yaml"), *short, *command[1:], *out, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr


def test_import_beside_puts_both_folders_on_the_path_of_the_processes_started(
    tmp_path, monkeypatch
):
    from hetps.runtime.import_path import import_beside

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    import_beside("configs/sine.yaml")
    roots = [str(tmp_path / "configs"), str(tmp_path)]
    assert sys.path[:2] == roots
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [*roots, "/elsewhere"]


# ------------------------------------------------------------ 2: the task's primary metric


def test_a_custom_task_without_a_target_watches_its_primary_metric(project, monkeypatch):
    assert resolved(project)["stop"]["target_accuracy"] is None  # not accuracy's 0.95
    monkeypatch.syspath_prepend(str(project))
    cfg = load_config(str(project / "sine.yaml"), import_targets=True)
    assert watched_metric(cfg, load_task(cfg)).name == "macro_f1"


def test_the_accuracy_default_stays_for_a_task_whose_primary_metric_is_accuracy(project):
    assert resolved(project, "task=mytask:AccuracyFirst")["stop"]["target_accuracy"] == 0.95


def test_hetps_run_from_python_settles_it_the_same_way(project, monkeypatch):
    """`hetps.run` hands every key over written out (target_accuracy: 0.95 included) to the
    load that imports the task (api/running.py): the value, not its being written, decides."""
    monkeypatch.syspath_prepend(str(project))
    written = config_to_dict(hetps.config(str(project / "sine.yaml"), task="mytask:MacroF1"))
    assert written["stop"]["target_accuracy"] == 0.95
    assert load_config(written, import_targets=True).stop.target_accuracy is None


def test_a_target_named_for_the_task_is_kept(project):
    stop = resolved(project, "stop.target_accuracy=0.9")["stop"]
    assert (stop["target"], stop["target_accuracy"]) == (None, 0.9)  # its accuracy metric
    stop = resolved(project, "stop.target={metric: macro_f1, value: 0.8}")["stop"]
    assert stop["target"] == {"metric": "macro_f1", "value": 0.8}


def test_an_accuracy_target_for_a_task_without_accuracy_is_refused(project):
    assert config_errors(project, "task=mytask:NoAccuracy", "stop.target_accuracy=0.9") == [
        "hetps: config error: stop.target_accuracy: task mytask:NoAccuracy has no accuracy "
        "metric (its metrics: macro_f1, loss); set stop.target: {metric: macro_f1, value: ...} "
        "instead"
    ]


# ------------------------------------------------------------ 3: errors before start


def test_metric_names_of_a_custom_task_are_checked_by_hetps_config(project):
    allowed = "allowed: macro_f1, accuracy, loss; did you mean 'macro_f1'?"
    assert config_errors(
        project, "eval.metric=f1", "stop.target={metric: f1_macro, value: 0.9}"
    ) == [
        f"hetps: config error: eval.metric: 'f1' is not a metric of task mytask:MacroF1; {allowed}",
        "hetps: config error: stop.target.metric: 'f1_macro' is not a metric of task "
        f"mytask:MacroF1; {allowed}",
    ]


def test_a_built_in_task_s_metric_name_says_did_you_mean(project):
    assert config_errors(project, "task=regression", "eval.metric=r_2") == [
        "hetps: config error: eval.metric: 'r_2' is not a metric of task regression; "
        "allowed: r2, mse, mae, loss; did you mean 'r2'?"
    ]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["sparse.tables=[emb]", "algorithm.name=diloco"],
            "sparse.tables: algorithm 'diloco' takes local steps (model averaging, DiLoCo), "
            "which sparse tables do not support; use sync, async, ssp, grouping, eager or "
            "balanced, or sparse.tables=[]",
        ),
        (
            ["sparse.tables=[emb]", "model.autocast=float16"],
            "sparse.tables: model.autocast float16 (loss scaling) is not supported with sparse "
            "tables; use bfloat16 or none",
        ),
        (  # the model's to say: built as the check before training builds it
            ["sparse.tables=[conv]"],
            "sparse.tables: 'conv' is not an nn.Embedding or nn.EmbeddingBag of model "
            "'mytask:Conv1DNet'; its embeddings: ['emb']",
        ),
    ],
)
def test_sparse_table_choices_the_config_alone_rules_out(project, overrides, line):
    assert config_errors(project, *overrides) == [f"hetps: config error: {line}"]


def test_every_factory_s_keywords_are_checked_with_the_close_name(project):
    assert config_errors(
        project,
        "task.kwargs={classes: 2}",
        "model.kwargs={input_shap: [1, 8]}",
        "data.dataset=mytask:waves",
        "data.kwargs={lenght: 8}",
        "optimizer.schedule.name=mytask:cosine",
        "optimizer.schedule.kwargs={tmax: 5}",
    ) == [
        "hetps: config error: model.kwargs: mytask:Conv1DNet(input_shape, num_classes) takes "
        "no keyword 'input_shap'; did you mean 'input_shape'?",
        "hetps: config error: data.kwargs: mytask:waves(length=8) takes no keyword 'lenght'; "
        "did you mean 'length'?",
        "hetps: config error: task.kwargs: mytask:MacroF1() takes no keyword 'classes'",
        "hetps: config error: optimizer.schedule.kwargs: mytask:cosine(optimizer, t_max) takes "
        "no keyword 'tmax'; did you mean 't_max'?",
    ]


# ------------------------------------------------------------ 6: the messages


def test_a_factory_name_says_did_you_mean_or_lists_the_module_s_own_callables(project):
    assert config_errors(project, "model.name=mytask:conv1") == [
        "hetps: config error: model.name: module 'mytask' has no callable 'conv1'; "
        "did you mean 'Conv1DNet'?"
    ]
    assert config_errors(project, "model.name=mytask:resnet") == [
        "hetps: config error: model.name: module 'mytask' has no callable 'resnet'; its own "
        "callables: MacroF1, AccuracyFirst, NoAccuracy, Conv1DNet, cosine, waves"
    ]


def test_a_module_that_does_not_import_is_one_line_for_every_key_naming_it(project):
    (line,) = config_errors(
        project, "task=nomodule:Task", "model.name=nomodule:Net", "data.dataset=nomodule:data"
    )
    assert line.startswith(
        "hetps: config error: model.name, data.dataset, task.name: cannot import 'nomodule' "
        "(ModuleNotFoundError: No module named 'nomodule'); the module must be importable on "
        "every host that builds it (the hetps commands look beside the config and in the "
        "current directory; "
    ), line


def test_a_node_list_of_bare_numbers_is_one_line_with_the_list_it_meant(project):
    assert config_errors(project, "cluster.workers=[1,1,3,3]") == [
        "hetps: config error: cluster.workers: each node of the list is a mapping of its "
        "settings, got [1, 1, 3, 3]: for nodes of those slowdowns write [{slowdown: 1}, "
        "{slowdown: 1}, {slowdown: 3}, {slowdown: 3}]; for 4 equal nodes, 4"
    ]


def test_a_built_in_schedule_s_key_beside_a_factory_is_refused(project):
    """Refused, not ignored (a factory builds the whole schedule, as Lightning's
    lr_scheduler config takes the scheduler object whole)."""
    assert config_errors(
        project,
        "optimizer.schedule.name=mytask:cosine",
        "optimizer.schedule.kwargs={t_max: 5}",
        "optimizer.schedule.warmup_steps=100",
    ) == [
        "hetps: config error: optimizer.schedule.warmup_steps: for the built-in schedules "
        "(constant, step, cosine), which mytask:cosine replaces (a factory builds the whole "
        "schedule, warm-up included); drop it, or pass it in optimizer.schedule.kwargs if the "
        "factory takes it (optimizer.schedule.kwargs={warmup_steps: 100})"
    ]
    resolved(
        project, "optimizer.schedule.name=mytask:cosine", "optimizer.schedule.kwargs={t_max: 5}"
    )


def test_the_user_module_is_named_in_no_error_once_it_imports(project):
    """The four keys that named mytask each said `cannot import 'mytask'` (issue 42, item 1)."""
    done = hetps_cli(
        "config",
        str(project / "sine.yaml"),
        "data.dataset=mytask:waves",
        "optimizer.schedule.name=mytask:cosine",
        "optimizer.schedule.kwargs={t_max: 5}",
        cwd=project.parent,
    )
    assert done.returncode == 0, done.stderr
    assert "cannot import" not in done.stderr
