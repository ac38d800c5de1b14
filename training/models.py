"""Model construction from a `ModelConfig`.

`build_model(cfg, in_shape, num_classes)` returns a freshly initialised
`torch.nn.Module` mapping a float batch of shape `(B, *in_shape)` to logits of
shape `(B, num_classes)`. `cfg.name` selects the model:

* a builtin name from `BUILTINS` ("mlp", "lenet5", "resnet20"), built for
  `in_shape` (any channel count; lenet5 and resnet20 expect images);
* any other name without ":" is a `torchvision.models` name, built with
  `weights=None` (torchvision models take the channel count they were designed
  for, usually 3, and ignore `in_shape`);
* "package.module:factory" imports the module and calls
  `factory(num_classes=..., input_shape=(C, H, W), **cfg.kwargs)`, passing
  each of `num_classes` and `input_shape` only if the factory takes it (by
  name, or through **kwargs); `cfg.kwargs` win over both.

`cfg.kwargs` go to the constructor in every case; a keyword the model does not
take raises `TypeError` naming the model. Unknown names and failed imports
raise `ModelError`.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetps.proto.errors import HetpsError
from hetps.runconfig.factories import FactoryError, load_factory
from hetps.runconfig.schema import ModelConfig


class ModelError(HetpsError, ValueError):
    """The configured model name cannot be resolved to a constructor."""


def _image_shape(model: str, in_shape: Sequence[int]) -> tuple[int, int, int]:
    if len(in_shape) != 3:
        raise ModelError(
            f"model {model!r} needs image inputs (C, H, W), got shape {tuple(in_shape)}"
        )
    return tuple(in_shape)


class MLP(nn.Sequential):
    """Flatten, then fully connected layers of sizes `hidden` with ReLU, then a linear head."""

    def __init__(
        self, in_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 128)
    ) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(in_shape)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


class LeNet5(nn.Module):
    """LeNet-5 (conv 6@5x5, pool, conv 16@5x5, pool, fc 120, fc 84, fc classes) with ReLU.

    Inputs smaller than 32x32 are zero-padded by the first convolution so that
    a 28x28 image yields the classic 16x5x5 feature map.
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _image_shape("lenet5", in_shape)
        padding = max(0, (32 - min(height, width)) // 2)
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *in_shape)).shape[1]
        self.classifier = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus an identity shortcut.

    When the block halves the resolution and doubles the channels, the shortcut
    is the parameter-free option A of He et al.: subsample by 2 and zero-pad the
    new channels.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            half = self.extra_channels // 2
            x = F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016): 3 stages of 3 basic blocks at 16/32/64 channels."""

    def __init__(self, in_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        in_channels = _image_shape("resnet20", in_shape)[0]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(3):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# Builtin name -> constructor taking (in_shape, num_classes, **kwargs).
BUILTINS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "lenet5": LeNet5,
    "resnet20": ResNet20,
}


def build_model(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A new, randomly initialised model for inputs `(B, *in_shape)` and `num_classes` logits."""
    if cfg.name in BUILTINS:
        return _build_builtin(cfg.name, tuple(in_shape), num_classes, cfg.kwargs)
    if ":" in cfg.name:
        return _build_from_factory(cfg.name, tuple(in_shape), num_classes, cfg.kwargs)
    return _build_torchvision(cfg.name, num_classes, cfg.kwargs)


def _build_builtin(
    name: str, in_shape: tuple[int, ...], num_classes: int, kwargs: dict
) -> nn.Module:
    builder = BUILTINS[name]
    try:
        inspect.signature(builder).bind(in_shape, num_classes, **kwargs)
    except TypeError as exc:
        accepted = [
            p for p in inspect.signature(builder).parameters if p not in ("in_shape", "num_classes")
        ]
        raise TypeError(
            f"model {name!r}: {exc}; accepted kwargs: {', '.join(accepted) or '(none)'}"
        ) from None
    return builder(in_shape, num_classes, **kwargs)


def _build_torchvision(name: str, num_classes: int, kwargs: dict) -> nn.Module:
    import torchvision  # deferred: slow to import and unused by the builtin models

    if name.lower() not in torchvision.models.list_models():
        raise ModelError(
            f"unknown model {name!r}; use one of {', '.join(BUILTINS)}, "
            "a torchvision.models name, or package.module:factory"
        )
    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except TypeError as exc:
        raise TypeError(f"model {name!r}: {exc}") from exc


def _offered(factory: Callable, offers: dict) -> dict:
    """The entries of `offers` that `factory` accepts by name or through **kwargs."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature (some builtins): offer everything
        return dict(offers)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offers)
    return {k: v for k, v in offers.items() if k in params}


def _build_from_factory(
    spec: str, in_shape: tuple[int, ...], num_classes: int, kwargs: dict
) -> nn.Module:
    try:
        factory = load_factory(spec, "model.name")
    except FactoryError as exc:
        raise ModelError(f"model {spec!r}: {exc.reason}") from exc
    try:
        offers = _offered(factory, {"num_classes": num_classes, "input_shape": in_shape})
        model = factory(**{**offers, **kwargs})
    except TypeError as exc:
        raise TypeError(f"model {spec!r}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
