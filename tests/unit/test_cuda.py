"""The CUDA path of a worker: gradients staged through pinned host buffers
with non-blocking copies (worker/state.py), pulled values copied onto the
GPU, batches moved with non_blocking; a GPU worker and a CPU worker push
the same gradients for the same model and batch (so they mix in one run).
Runs only where CUDA exists; bench/gpu_check.py checks a GPU machine end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetps.runconfig.schema import ModelConfig
from hetps.training.models import build_model
from hetps.training.state import ModelState

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the pinned-buffer path of worker/state.py runs "
    "only on GPU workers (bench/gpu_check.py covers a GPU machine)",
)

IN_SHAPE, CLASSES = (1, 28, 28), 10


def lenet(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="lenet5"), IN_SHAPE, CLASSES).to(device)


def backward(state: ModelState, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, *IN_SHAPE, generator=g), torch.randint(0, CLASSES, (16,), generator=g)
    model = state.model
    model.zero_grad(set_to_none=True)
    F.cross_entropy(
        model(x.to(state.device, non_blocking=True)), y.to(state.device, non_blocking=True)
    ).backward()


def test_gradients_leave_through_reused_pinned_buffers_and_match_the_gpu_values():
    state = ModelState(lenet("cuda"), torch.device("cuda"))
    backward(state, 1)
    first = state.outgoing()
    for name, (t, kind) in state.tensors.items():
        out = first[name]
        assert out.device.type == "cpu" and out.is_pinned(), name
        want = (t.grad if kind == "param" else t).detach().cpu()
        # the non-blocking copy completed before outgoing() returned
        assert torch.equal(out, want), name
    pointers = {n: t.data_ptr() for n, t in first.items()}
    before = {n: t.clone() for n, t in first.items()}
    backward(state, 2)
    second = state.outgoing()
    assert {n: t.data_ptr() for n, t in second.items()} == pointers  # staging buffers are reused
    changed = [
        n
        for n, (t, kind) in state.tensors.items()
        if kind == "param" and not torch.equal(second[n], before[n])
    ]
    assert changed and all(torch.equal(second[n], state.tensors[n][0].grad.cpu()) for n in changed)


def test_pulled_values_land_on_the_gpu():
    state = ModelState(lenet("cuda"), torch.device("cuda"))
    values = {n: torch.full(t.shape, 0.25, dtype=t.dtype) for n, (t, _) in state.tensors.items()}
    state.load(values)
    torch.cuda.synchronize()
    for name, (t, _) in state.tensors.items():
        assert t.device.type == "cuda" and torch.equal(t.cpu(), values[name]), name


def test_a_gpu_worker_and_a_cpu_worker_push_the_same_gradients():
    gpu, cpu = (
        ModelState(lenet("cuda"), torch.device("cuda")),
        ModelState(lenet("cpu"), torch.device("cpu")),
    )
    backward(gpu, 3)
    backward(cpu, 3)
    got, want = gpu.outgoing(), cpu.outgoing()
    assert list(got) == list(want)
    for name in want:  # same math on two devices: equal up to float rounding
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["auto", "cuda", "cuda:0"])
def test_every_gpu_device_name_becomes_an_indexed_current_device(name):
    from hetps.runtime.devices import pick_device, use_device

    device = pick_device(name, "cluster.workers.0.device")
    assert device == torch.device("cuda", 0)  # set_device refuses a bare "cuda"
    use_device(device)
    assert torch.cuda.current_device() == 0
