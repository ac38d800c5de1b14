"""The task contract (worker/task.py): the built-in tasks' metrics from sums
equal the same metrics computed over the whole test set at once (uneven
batches), factory tasks and their one-line errors, the watched metric,
gradient accumulation, float16 loss scaling, the dry step's refusals,
loader-fed batches (dict batches, iterable datasets and their shares), and
the schedule factory."""

from __future__ import annotations

import math
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetps.runconfig.load import load_config
from hetps.training.task import (
    Classification,
    LanguageModel,
    Metric,
    Regression,
    TaskError,
    evaluate_task,
    load_task,
    move,
    watched_metric,
)

UNEVEN = (7, 1, 13, 19)  # batch sizes of one test set of 40


def batches_of(x, y, sizes=UNEVEN):
    out, start = [], 0
    for n in sizes:
        out.append((x[start : start + n], y[start : start + n]))
        start += n
    assert start == len(y)
    return out


def test_regression_metrics_from_sums_equal_whole_set_values():
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40) * 4 + 2
    model = nn.Linear(3, 1)
    pred = model(x).squeeze(-1).detach().double()
    y64 = y.double()
    sse = float(((pred - y64) ** 2).sum())
    r2 = 1 - sse / float(((y64 - y64.mean()) ** 2).sum())
    got = evaluate_task(Regression(), model, batches_of(x, y), "cpu")
    assert got["r2"] == pytest.approx(r2, rel=1e-9, abs=1e-12)
    assert got["mse"] == pytest.approx(sse / 40, rel=1e-9) == got["loss"]
    assert got["mae"] == pytest.approx(float((pred - y64).abs().mean()), rel=1e-9)
    assert got["r2"] < 0.5  # an untrained model: far from fitting (the value is real, not 1)


def test_language_model_perplexity_from_sums_equals_whole_set_value():
    torch.manual_seed(1)
    vocab = 11
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
    x = torch.randint(vocab, (40, 6))
    y = torch.randint(vocab, (40, 6))
    y[3, 2:] = -100  # padding: not counted
    logits = model(x).detach()
    nll = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-100)
    counted = y != -100
    accuracy = float(((logits.argmax(-1) == y) & counted).sum() / counted.sum())
    got = evaluate_task(LanguageModel(), model, batches_of(x, y), "cpu")
    assert got["loss"] == pytest.approx(float(nll), rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-6)
    assert got["token_accuracy"] == pytest.approx(accuracy)
    # a mean of the batches' perplexities would differ: the sums are what make it right
    per_batch = [math.exp(float(LanguageModel().loss(model, b).detach())) for b in batches_of(x, y)]
    assert abs(sum(per_batch) / len(per_batch) - got["perplexity"]) > 1e-4
    assert LanguageModel().batch_size((x, y)) == 40


def test_classification_metrics_and_defaults():
    torch.manual_seed(2)
    x, y = torch.randn(40, 5), torch.randint(3, (40,))
    model = nn.Linear(5, 3)
    logits = model(x).detach()
    got = evaluate_task(Classification(3), model, batches_of(x, y), "cpu")
    assert got["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert got["loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    task = Classification(3)
    assert [m.name for m in task.metrics] == ["accuracy", "loss"] and task.metrics[
        0
    ].higher_is_better
    assert task.batch_size({"a": [torch.zeros(4, 2)], "b": 1}) == 4


def test_move_keeps_nested_structure():
    batch = {"ids": torch.ones(2, 3), "extra": (torch.zeros(2), [torch.ones(1)]), "n": 5}
    moved = move(batch, "cpu")
    assert moved.keys() == batch.keys() and moved["n"] == 5
    assert isinstance(moved["extra"], tuple) and isinstance(moved["extra"][1], list)


FACTORIES = """
import torch
import torch.nn.functional as F
from hetps.training.task import Metric, Task


class DictTask(Task):
    name = "dict_regression"
    metrics = (Metric("loss", False),)

    def __init__(self, weight=1.0):
        self.weight = weight

    def loss(self, model, batch):
        return self.weight * F.mse_loss(model(batch["features"]).squeeze(-1), batch["target"])


def dict_task(weight=1.0):
    return DictTask(weight)


class Bare:  # not a Task: only a loss
    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).squeeze(-1), y)


def bare():
    return Bare()


def no_loss():
    return object()


def no_loss_metric():
    t = Bare()
    t.metrics = [Metric("mae", False)]
    return t


def a_class():
    return DictTask


def halving(optimizer, every=2):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=every, gamma=0.5)


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


class OnlyStep:
    def step(self):
        pass


def only_step(optimizer):
    return OnlyStep()
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "tests_task_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tests_task_factories"


def cfg_of(*overrides):
    return load_config(None, list(overrides))


def test_factory_tasks_load_with_kwargs_and_defaults(factories):
    task = load_task(cfg_of(f"task.name={factories}:dict_task", "task.kwargs={weight: 2.0}"))
    assert task.name == "dict_regression" and task.weight == 2.0
    bare = load_task(cfg_of(f"task={factories}:bare"))
    # an object with only loss(): the rest are Task's defaults (mean loss over the test set)
    assert [m.name for m in bare.metrics] == ["loss"] and bare.name == "bare"
    model = nn.Linear(2, 1)
    x, y = torch.randn(10, 2), torch.randn(10)
    got = evaluate_task(bare, model, batches_of(x, y, (3, 7)), "cpu")
    assert got["loss"] == pytest.approx(
        float(F.mse_loss(model(x).squeeze(-1), y).detach()), rel=1e-6
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["task=tests_task_factories:no_loss"], "has no loss(model, batch)"),
        (["task=tests_task_factories:no_loss_metric"], "metrics must include Metric('loss'"),
        (["task=tests_task_factories:a_class"], "returned the class DictTask"),
        (["task=tests_task_factories:bare", "task.kwargs={x: 1}"], "calling it with task.kwargs"),
        (["task=tests_task_factories:nothing"], "cannot load the factory"),
        (["task=regression", "task.kwargs={x: 1}"], None),  # refused by the config checks
    ],
)
def test_factory_task_errors_are_one_line_naming_task_name(factories, overrides, words):
    if words is None:
        with pytest.raises(
            Exception, match=re.escape("task.kwargs: only for a package.module:factory")
        ):
            cfg_of(*overrides)
        return
    with pytest.raises(TaskError) as info:
        load_task(cfg_of(*overrides))
    message = str(info.value)
    assert "\n" not in message and words in message and "task" in message


def test_watched_metric_rule():
    lm = LanguageModel()
    assert watched_metric(cfg_of("task=language_model"), lm).name == "perplexity"
    # the classification shorthand: ignored for a task without accuracy
    assert watched_metric(cfg_of("stop.target_accuracy=0.9"), lm).name == "perplexity"
    assert watched_metric(cfg_of(), Classification(10)) == Metric("accuracy", True)
    assert watched_metric(cfg_of("stop.target_accuracy=null"), Regression()).name == "r2"
    # eval.metric wins over the stop target (the default target_accuracy of 0.95 included)
    assert watched_metric(cfg_of("eval.metric=loss"), Classification(10)) == Metric("loss", False)
    cfg = cfg_of("task=language_model", "stop.target={metric: token_accuracy, value: 0.5}")
    assert watched_metric(cfg, lm).name == "token_accuracy"
    cfg = cfg_of(
        "task=language_model",
        "stop.target={metric: token_accuracy, value: 0.5}",
        "eval.metric=perplexity",
    )
    assert watched_metric(cfg, lm).name == "perplexity"


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def gradient_of(cfg, data, model, plan_batch):
    from hetps.proto.plan import ClusterPlan, NodeEntry
    from hetps.training.state import ModelState
    from hetps.training.step import GradientStep

    plan = ClusterPlan(
        plan_id=1, algorithm="sync", workers=[NodeEntry(5, 0)], shards=[], tensors=[], placement={}
    )
    work = GradientStep(cfg, ModelState(model, torch.device("cpu")), data, 5, plan)
    assert work.batch_size == plan_batch
    work.compute()
    return work, {n: p.grad.clone() for n, p in model.named_parameters()}


def array_data(n=24):
    from hetps.training.data import ArrayDataset, Datasets

    g = torch.Generator().manual_seed(3)
    train = ArrayDataset(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
    return Datasets(train=train, test=train, in_shape=(4,), num_classes=3)


def test_accumulation_equals_one_big_batch():
    data = array_data()
    torch.manual_seed(0)
    model = Tiny()
    small = model
    big = Tiny()
    big.load_state_dict(model.state_dict())
    work, accumulated = gradient_of(
        cfg_of("data.batch_size=6", "data.accumulate=4"), data, small, 6
    )
    _, whole = gradient_of(cfg_of("data.batch_size=24"), data, big, 24)
    # 4 batches of 6 from a 24-example share: the same examples as one batch of 24 (one epoch)
    assert work.samples == 24 and work.step_samples == 24
    for name in whole:
        assert torch.allclose(accumulated[name], whole[name], atol=1e-6), name


def test_float16_loss_scaling_unscales_and_retries_on_overflow():
    from hetps.training.step import LossScale

    data = array_data()
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            nn.Linear(4, 3)(torch.randn(2, 4))
    except RuntimeError as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"float16 autocast does not run on this CPU torch: {exc}")
    torch.manual_seed(0)
    model = Tiny()
    ref = Tiny()
    ref.load_state_dict(model.state_dict())
    work, scaled = gradient_of(
        cfg_of("data.batch_size=24", "model.autocast=float16"), data, model, 24
    )
    _, plain = gradient_of(cfg_of("data.batch_size=24"), data, ref, 24)
    assert work.scaler.scale == 2.0**16 and work.overflows == 0
    for name in plain:  # unscaled: the float32 gradient up to float16 rounding
        assert torch.allclose(scaled[name], plain[name], rtol=2e-2, atol=2e-3), name
    # an overflow halves the scale and asks for the step again; a finite one keeps it
    scale = LossScale(init=8.0, interval=2)
    g = [torch.tensor([1.0, math.inf])]
    assert not scale.unscale(g) and scale.scale == 4.0
    g = [torch.tensor([8.0])]
    assert scale.unscale(g) and g[0].item() == 2.0
    assert scale.unscale([torch.tensor([1.0])]) and scale.scale == 8.0  # 2 good steps: doubled


NAN_FIRST = """
import torch
from torch import nn


class NotScalar:
    def loss(self, model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def not_scalar():
    return NotScalar()


class NanLoss:
    def loss(self, model, batch):
        x, _ = batch
        return model(x).sum() * float("nan")


def nan_loss():
    return NanLoss()


class Frozen(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.fc = nn.Linear(input_shape[0], num_classes)
        self.fc.requires_grad_(False)

    def forward(self, x):
        return self.fc(x)


def frozen(num_classes, input_shape):
    return Frozen(num_classes, input_shape)
"""


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["task=tests_nan_task:not_scalar"],
            "the loss must be a scalar tensor, got a tensor of shape (32,)",
        ),
        (["task=tests_nan_task:nan_loss"], "the loss is nan at the first step"),
        (["model.name=tests_nan_task:frozen"], "no parameter of the model gets a gradient"),
        (
            ["data.dataset=tests_nan_task:unlabelled"],
            "the class count is unknown; fix: set data.num_classes",
        ),
    ],
)
def test_dry_step_refuses_in_one_line(tmp_path, monkeypatch, overrides, words):
    from hetps.training.preflight import PreflightError, build_checked

    (tmp_path / "tests_nan_task.py").write_text(
        NAN_FIRST
        + textwrap.dedent(
            """
            def unlabelled():
                d = [(torch.randn(4), i % 3) for i in range(40)]
                return d, d
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = cfg_of("data.dataset=synthetic", "data.synthetic.shape=[4]", "model.name=mlp", *overrides)
    with pytest.raises(PreflightError) as info:
        build_checked(cfg)
    message = str(info.value)
    assert "\n" not in message and words in message, message
    if "data.dataset" not in overrides[0]:
        assert (
            message.startswith("task ") and "model " in message and "dataset 'synthetic'" in message
        )
    # the class count from the config instead: accepted
    if "unlabelled" in overrides[0]:
        build_checked(
            cfg_of(
                *[f"{o}" for o in ("data.dataset=tests_nan_task:unlabelled",)],
                "model.name=mlp",
                "data.num_classes=3",
            )
        )


DICT_AND_STREAM = """
import torch
import torch.nn.functional as F
from torch import nn
from hetps.training.task import Metric, Task

W = torch.tensor([1.5, -2.0, 0.5])


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": (self.x[i] @ W).float()}


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n, seed):
        self.rows = Rows(n, seed)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        for i in range(len(self.rows)):
            item = self.rows[i]
            yield item["features"], item["target"]


def rows():
    return Rows(64, 0), Rows(32, 1)


def stream():
    return Stream(64, 0), Stream(32, 1)


class DictTask(Task):
    name = "dict_regression"
    metrics = (Metric("mse", False), Metric("loss", False))

    def loss(self, model, batch):
        return F.mse_loss(model(batch["features"]).squeeze(-1), batch["target"])

    def eval_sums(self, model, batch):
        err = model(batch["features"]).squeeze(-1) - batch["target"]
        return {"sse": float((err * err).sum()), "n": len(err)}

    def reduce(self, sums):
        return {"mse": sums["sse"] / sums["n"], "loss": sums["sse"] / sums["n"]}


def dict_task():
    return DictTask()


def linear(input_shape=None):
    return nn.Linear(3, 1)
"""


@pytest.fixture
def stream_pkg(tmp_path, monkeypatch):
    (tmp_path / "tests_stream_data.py").write_text(DICT_AND_STREAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tests_stream_data"


def train_locally(cfg, steps=150):
    """`steps` of GradientStep + SGD in this process (one worker); the test metrics after."""
    from hetps.proto.plan import ClusterPlan, NodeEntry
    from hetps.training.measure import measure
    from hetps.training.preflight import build_checked
    from hetps.training.state import ModelState
    from hetps.training.step import GradientStep, task_for

    data, model = build_checked(cfg)
    task = task_for(cfg, data.num_classes)
    plan = ClusterPlan(
        plan_id=1, algorithm="sync", workers=[NodeEntry(5, 0)], shards=[], tensors=[], placement={}
    )
    work = GradientStep(cfg, ModelState(model, torch.device("cpu")), data, 5, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = measure(task, model, data.test, cfg, "cpu")
    for _ in range(steps):
        work.compute()
        opt.step()
    return before, measure(task, model, data.test, cfg, "cpu"), work


def test_a_dict_batch_task_trains_and_evaluates(stream_pkg):
    cfg = cfg_of(
        f"task={stream_pkg}:dict_task", f"data.dataset={stream_pkg}:rows",
        f"model.name={stream_pkg}:linear", "data.batch_size=8",
    )  # fmt: skip
    before, after, work = train_locally(cfg)
    assert after["mse"] < 0.01 * before["mse"] and after["mse"] < 0.01, (before, after)
    assert work.samples == 150 * 8


def test_an_iterable_dataset_regression_trains_and_evaluates(stream_pkg):
    cfg = cfg_of(
        "task=regression", f"data.dataset={stream_pkg}:stream",
        f"model.name={stream_pkg}:linear", "data.batch_size=8", "data.eval_batch_size=5",
    )  # fmt: skip
    before, after, work = train_locally(cfg)
    assert after["r2"] > 0.99 > before["r2"], (before, after)
    assert after["loss"] == after["mse"]
    # the stream was read over several epochs (64 examples, 150 x 8 read), set_epoch each time
    assert work.data.train.dataset.epochs[:3] == [0, 1, 2]


def test_stream_shares_are_disjoint_cover_and_follow_weights(stream_pkg):
    import importlib
    from itertools import islice

    from hetps.training.user_data import StreamDataset, owner

    mod = importlib.import_module(stream_pkg)
    stream = StreamDataset(mod.Stream(60, 0), "s", "train")
    keys = [tuple(x.tolist()) for x, _ in stream]
    taken = [[tuple(x.tolist()) for x, _ in islice(iter(stream.share(r, 3)), 20)] for r in range(3)]
    assert sorted(sum(taken, [])) == sorted(keys)  # one epoch: each element to exactly one worker
    counts = [0, 0]
    for i in range(1000):  # weighted shares: 3 to 1
        counts[owner(i, 2, [0.75, 1.0])] += 1
    assert abs(counts[0] - 750) <= 2


def flat(batch) -> list[tuple]:
    """A batch's examples as tuples of numbers (dict or (x, y) batches)."""
    parts = list(batch.values()) if isinstance(batch, dict) else list(batch)
    rows = [p.reshape(len(p), -1).float() for p in parts]
    return [tuple(torch.cat([r[i] for r in rows]).tolist()) for i in range(len(rows[0]))]


def test_loader_processes_give_the_same_batches(stream_pkg):
    """data.num_workers: batches read ahead by loader processes hold what the
    worker's own process reads: the same batches for a map-style dataset;
    the same examples of the share for a stream (its loader processes split
    the share between them and batch their parts)."""
    from hetps.training.data import load_datasets, stream_share
    from hetps.training.task import Task

    for dataset in ("rows", "stream"):
        cfg = cfg_of(f"data.dataset={stream_pkg}:{dataset}")
        data = load_datasets(cfg.data, 0)
        streams = [
            stream_share(data.train, 1, 2, None, 4, 0, 7, Task().collate, workers)
            for workers in (0, 2)
        ]
        # 8 batches of 4: one epoch of a 32-example share
        got = [[flat(s.next_batch()) for _ in range(8)] for s in streams]
        if dataset == "rows":
            assert got[0] == got[1]
        else:
            assert sorted(sum(got[0], [])) == sorted(sum(got[1], []))
            assert len(set(sum(got[0], []))) == 32


def test_the_test_split_is_read_once_whatever_its_loader_processes(stream_pkg):
    """data.num_workers for the evaluation: each test example once per evaluation, for a
    map-style split and a stream (each loader process used to read the whole stream), and
    again at the next evaluation from the same loader (its processes kept)."""
    from hetps.training.data import load_datasets, test_batches
    from hetps.training.task import Task

    for dataset in ("rows", "stream"):
        cfg = cfg_of(f"data.dataset={stream_pkg}:{dataset}")
        test = load_datasets(cfg.data, 0).test
        alone = sorted(sum((flat(b) for b in test_batches(test, 5, Task().collate)), []))
        assert len(alone) == 32 == len(set(alone))
        batches = test_batches(test, 5, Task().collate, num_workers=2, persistent=True)
        for _ in range(2):  # two evaluations
            assert sorted(sum((flat(b) for b in batches), [])) == alone, dataset


def test_schedule_factory_builds_the_users_scheduler(factories):
    from hetps.runtime.optim import build_lr_scheduler

    cfg = cfg_of(
        f"optimizer.schedule.name={factories}:halving", "optimizer.schedule.kwargs={every: 1}"
    )
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, cfg.optimizer.schedule)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="optimizer.schedule.name"):
        bad = cfg_of(
            f"optimizer.schedule.name={factories}:halving", "optimizer.schedule.kwargs={x: 1}"
        )
        build_lr_scheduler(opt, bad.optimizer.schedule)
    # the shards checkpoint the schedule and step it without a metric: refused up front
    for name, words in (("plateau", "ReduceLROnPlateau"), ("only_step", "state_dict")):
        bad = cfg_of(f"optimizer.schedule.name={factories}:{name}")
        with pytest.raises(ValueError, match=words):
            build_lr_scheduler(opt, bad.optimizer.schedule)
