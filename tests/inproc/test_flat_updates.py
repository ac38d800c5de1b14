"""The shard's flat layout (ps/arena.py) gives the values of plain per-tensor
torch.optim: the store's parameters live in one flat run per dtype, the
Updater steps a real optimizer over those runs, and after several steps with
an lr schedule (and a damped step, as grouping makes) every tensor and every
piece of optimizer state equals that of an optimizer over the separate
tensors. A checkpoint's optimizer state keeps the per-tensor form and
restores into either layout. Pure, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from shard_harness import values_of

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Push
from hetps.proto.plan import TensorSpec
from hetps.proto.tensors import Tensors
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater
from hetps.runconfig.load import load_config
from hetps.runtime.optim import build_lr_scheduler, build_optimizer
from hetps.training.state import model_specs

# odd sizes (padding inside the float32 run), two parameter dtypes, buffers in between
SPECS = [
    TensorSpec("conv.weight", "float32", (3, 1, 3, 3), "param"),
    TensorSpec("conv.bias", "float32", (3,), "param"),
    TensorSpec("bn.running_mean", "float32", (3,), "buffer"),
    TensorSpec("bn.num_batches_tracked", "int64", (), "buffer"),
    TensorSpec("fc.weight", "float64", (5, 7), "param"),
    TensorSpec("fc.bias", "float32", (5,), "param"),
    TensorSpec("scale", "float32", (), "param"),
]
PARAMS = [s.name for s in SPECS if s.kind == "param"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
STEPS = 8
# lr_scale per step (grouping damps stale updates)
SCALES = [1.0, 1.0, 0.5, 1.0, 1.0, 0.25, 1.0, 1.0]

CASES = {
    "sgd": ["optimizer.momentum=0"],
    "sgd-momentum-nesterov": [
        "optimizer.momentum=0.9",
        "optimizer.nesterov=true",
        "optimizer.schedule.name=step",
        "optimizer.schedule.step_size=3",
        "optimizer.schedule.gamma=0.5",
    ],
    "sgd-weight-decay": [
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=0.01",
        "optimizer.schedule.name=cosine",
        "optimizer.schedule.total_steps=10",
    ],
    "adam": [
        "optimizer.name=adam",
        "optimizer.lr=0.01",
        "optimizer.weight_decay=0.001",
        "optimizer.schedule.warmup_steps=3",
        "optimizer.schedule.name=cosine",
        "optimizer.schedule.total_steps=12",
    ],
    "adamw": [
        "optimizer.name=adamw",
        "optimizer.lr=0.01",
        "optimizer.weight_decay=0.1",
        "optimizer.schedule.name=step",
        "optimizer.schedule.step_size=2",
    ],
}
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def initial_values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        s.name: (
            torch.randn(s.shape, generator=g, dtype=DTYPES[s.dtype])
            if s.dtype != "int64"
            else torch.tensor(4)
        )
        for s in SPECS
    }


def gradients(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {
        s.name: torch.randn(s.shape, generator=g, dtype=DTYPES[s.dtype])
        for s in SPECS
        if s.kind == "param"
    }


def flat_shard(cfg) -> tuple[TensorStore, Updater]:
    store = TensorStore(SPECS)
    store.initialize(initial_values())
    return store, Updater(store.tensors, store.param_names(), cfg.optimizer, store.arena)


class Reference:
    """torch.optim over the separate tensors, as a shard without the arena would run it."""

    def __init__(self, cfg):
        self.params = {n: t.clone() for n, t in initial_values().items() if n in PARAMS}
        self.optimizer = build_optimizer(list(self.params.values()), cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer.schedule)

    def step(self, grads: dict, lr_scale: float) -> None:
        for n, p in self.params.items():
            p.grad = grads[n]
        for group in self.optimizer.param_groups:
            group["lr"] *= lr_scale
        self.optimizer.step()
        for group in self.optimizer.param_groups:
            group["lr"] /= lr_scale
        self.scheduler.step()


def assert_same_state(flat_state: dict, reference_state: dict) -> None:
    assert flat_state["state"].keys() == reference_state["state"].keys()
    for i, entry in reference_state["state"].items():
        assert flat_state["state"][i].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(flat_state["state"][i][key], value, **TIGHT)

    def options(groups):  # `foreach` says how a step runs, not what it computes
        return [{k: v for k, v in g.items() if k != "foreach"} for g in groups]

    assert options(flat_state["param_groups"]) == options(reference_state["param_groups"])


@pytest.mark.parametrize("case", list(CASES))
def test_flat_updates_equal_per_tensor_torch_optim(case):
    cfg = load_config(None, CASES[case])
    store, updater = flat_shard(cfg)
    reference = Reference(cfg)
    # one flat run per dtype, not 5 tensors
    assert len(updater.optimizer.param_groups[0]["params"]) == 2
    assert updater.optimizer.param_groups[0]["foreach"] is False  # it reads the gradients only
    for step in range(STEPS):
        grads = gradients(step)
        updater.apply(grads, lr_scale=SCALES[step])
        reference.step(grads, SCALES[step])
        assert updater.lr == pytest.approx(reference.optimizer.param_groups[0]["lr"])
    for n in PARAMS:
        torch.testing.assert_close(store.tensors[n], reference.params[n], **TIGHT)
        assert not torch.equal(store.tensors[n], initial_values()[n]), n  # it did train
    assert_same_state(updater.state_dict()["optimizer"], reference.optimizer.state_dict())
    for run in store.arena.flat.values():  # padding never becomes anything but zero
        covered = sum(
            store.tensors[n].numel() for n in PARAMS if store.tensors[n].dtype == run.dtype
        )
        assert run.numel() >= covered


@pytest.mark.parametrize("case", ["sgd-momentum-nesterov", "adam"])
def test_a_checkpoint_restores_and_training_continues_identically(case):
    cfg = load_config(None, CASES[case])
    store, updater = flat_shard(cfg)
    for step in range(3):
        updater.apply(gradients(step))
    saved = copy.deepcopy({"store": store.state_dict(), "updater": updater.state_dict()})

    restored_store = TensorStore(SPECS)
    restored_store.load_state_dict(copy.deepcopy(saved["store"]))
    restored = Updater(
        restored_store.tensors, restored_store.param_names(), cfg.optimizer, restored_store.arena
    )
    restored.load_state_dict(copy.deepcopy(saved["updater"]))
    assert_same_state(restored.state_dict()["optimizer"], saved["updater"]["optimizer"])
    assert restored.optimizer.param_groups[0]["foreach"] is False
    for step in range(3, STEPS):
        updater.apply(gradients(step), lr_scale=SCALES[step])
        restored.apply(gradients(step), lr_scale=SCALES[step])
    for n in store.tensors:
        assert torch.equal(restored_store.tensors[n], store.tensors[n]), n
    assert restored.updates == updater.updates == STEPS and restored.lr == updater.lr


def test_per_tensor_optimizer_state_restores_into_the_flat_layout():
    """A checkpoint written by an optimizer over the separate tensors (older
    shards) restores into the flat layout and trains on identically."""
    cfg = load_config(None, CASES["adam"])
    reference = Reference(cfg)
    for step in range(3):
        reference.step(gradients(step), 1.0)
    store = TensorStore(SPECS)
    store.initialize({**initial_values(), **reference.params})
    updater = Updater(store.tensors, store.param_names(), cfg.optimizer, store.arena)
    updater.load_state_dict(
        {
            "updates": 3,
            "optimizer": copy.deepcopy(reference.optimizer.state_dict()),
            "scheduler": reference.scheduler.state_dict(),
        }
    )
    for step in range(3, STEPS):
        reference.step(gradients(step), 1.0)
        updater.apply(gradients(step))
    for n in PARAMS:
        torch.testing.assert_close(store.tensors[n], reference.params[n], **TIGHT)


def test_a_packed_push_is_the_gradient_run_itself():
    """Gradients decoded from a one-frame push lie in the flat run's layout:
    the optimizer reads them where they arrived (no gather copy) and never
    writes them (Nesterov's term included)."""
    cfg = load_config(None, CASES["sgd-momentum-nesterov"])
    specs = [s for s in SPECS if s.dtype == "float32" and s.kind == "param"]
    names = [s.name for s in specs]
    store = TensorStore(specs)
    store.initialize({n: t for n, t in initial_values().items() if n in names})
    updater = Updater(store.tensors, store.param_names(), cfg.optimizer, store.arena)
    reference = {n: t.clone() for n, t in initial_values().items() if n in names}
    ref_opt = build_optimizer(list(reference.values()), cfg.optimizer)
    for step in range(3):
        pushed = {n: g for n, g in gradients(step).items() if n in names}
        frames = encode(Push(plan_id=1, clock=step, base_version=0, tensors=pushed))
        assert len(frames) == 2  # header + one pack frame
        received = decode(frames).msg.tensors
        updater.apply(received)
        assert not updater.flat_grads[0].any()  # the shard's own gradient buffer was not needed
        for n, g in pushed.items():
            assert torch.equal(received[n], g), n  # the peer's frame is read, never written
            reference[n].grad = g
        ref_opt.step()
    for n in names:
        torch.testing.assert_close(store.tensors[n], reference[n], **TIGHT)


def test_a_settle_moves_the_arena_and_keeps_the_optimizer_on_it():
    """A reply still reading the tensors: the next write moves the whole
    arena; views, flat runs and the optimizer's parameters move together."""
    cfg = load_config(None, CASES["sgd-momentum-nesterov"])
    store, updater = flat_shard(cfg)
    lent = store.snapshot()  # handed out, never tracked: counts as in flight
    kept = {n: t.clone() for n, t in lent.items()}
    store.settle()
    assert store.snapshots.moves == 1
    updater.apply(gradients(0))
    for n in PARAMS:
        assert torch.equal(lent[n], kept[n]), n  # the reply's memory is untouched
        assert not torch.equal(store.tensors[n], kept[n]), n  # the live tensors took the update
    flat = store.arena.flat[torch.float32]
    assert (
        store.tensors["conv.bias"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    )
    assert updater.optimizer.param_groups[0]["params"][0] is flat


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.startswith("sgd")] + ["sgd-dampened-maximized"]
)
def test_direct_sgd_steps_are_bit_equal_to_torch_optim(case):
    """Plain SGD over the flat runs steps through updater.sgd_step after its
    first step: values, momentum buffers and lr equal torch.optim's bit for bit,
    under an lr schedule and damped steps, from packed pushes and gathered ones."""
    overrides = CASES.get(
        case, ["optimizer.momentum=0.5", "optimizer.nesterov=false", "optimizer.weight_decay=0.02"]
    )
    cfg = load_config(None, overrides)
    (store, direct), (ref_store, reference) = flat_shard(cfg), flat_shard(cfg)
    assert direct._direct
    reference._direct = False  # torch.optim's step every time
    if case == "sgd-dampened-maximized":
        for opt in (direct.optimizer, reference.optimizer):
            opt.param_groups[0].update(dampening=0.25, maximize=True)
    for step in range(STEPS):
        grads = gradients(step)
        if step % 2:  # a one-frame push: the flat gradient is the frame itself
            grads = decode(
                encode(Push(plan_id=1, clock=step, base_version=0, tensors=grads))
            ).msg.tensors
        direct.apply(grads, lr_scale=SCALES[step])
        reference.apply(grads, lr_scale=SCALES[step])
        assert direct.lr == reference.lr
    for n in store.tensors:
        assert torch.equal(store.tensors[n], ref_store.tensors[n]), n
        assert not torch.equal(store.tensors[n], initial_values()[n]) or n not in PARAMS, n
    mine, theirs = direct.optimizer.state_dict(), reference.optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for i, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(mine["state"][i][key], value), (i, key)
    assert direct.updates == reference.updates == STEPS


@pytest.mark.parametrize(
    "algorithm, workers", [("async", [11]), ("sync", [11]), ("sync", [11, 12, 13])]
)
def test_a_shard_hands_the_decoded_push_and_its_runs_to_the_optimizer(
    monkeypatch, harnesses, algorithm, workers
):
    """Through a real shard (mem:// transport): a push of exactly the
    parameters reaches the updater as a Tensors whose flat runs are known (the
    decoded push itself under async and in a one-member sync round; a sync
    round's sum, added run by run, otherwise), so the optimizer steps on the
    runs (no gather copy, no search for runs); the values are torch.optim's
    over the separate tensors, stepping on each round's mean."""
    torch.manual_seed(1)
    # odd last bias: padding
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3))
    seen = []
    real_apply = Updater.apply

    def recording(self, grads, *args, **kwargs):
        seen.append(isinstance(grads, Tensors) and bool(grads.runs))
        return real_apply(self, grads, *args, **kwargs)

    monkeypatch.setattr(Updater, "apply", recording)
    harness = harnesses(
        model_specs(model),
        ["optimizer.momentum=0.9", "optimizer.nesterov=true"],
        workers,
        1,
        algorithm,
    )
    harness.init(values_of(model))
    reference = {n: t.clone() for n, t in values_of(model).items()}
    ref_opt = build_optimizer(list(reference.values()), harness.cfg.optimizer)
    for step in range(3):
        pushed = []
        for w in workers:
            g = torch.Generator().manual_seed(10 * step + w)
            pushed.append({n: torch.randn(t.shape, generator=g) for n, t in reference.items()})
            harness.push(w, step, pushed[-1], base_version=step)
        for n, p in reference.items():
            total = pushed[0][n].clone()
            for grads in pushed[1:]:
                total += grads[n]
            p.grad = total / len(pushed)
        ref_opt.step()
    updater = harness.shards[0].policy.updater
    assert seen == [True, True, True]
    assert not any(g.any() for g in updater.flat_grads)  # its own gradient buffer was never needed
    for n, value in harness.values().items():
        torch.testing.assert_close(value, reference[n], **TIGHT)
