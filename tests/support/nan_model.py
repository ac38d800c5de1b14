"""A user model (`model.name: nan_model:lenet5_nan_when_told`) that turns
one worker bad on demand: the builtin LeNet-5, whose training forward passes
give NaN logits, hence a NaN loss and NaN gradients, once the process has
run HETPS_TEST_NAN_AFTER of them. Only the process started with that
variable is bad; the others (and every forward in eval mode, the
evaluator's) are the plain model. Import it by putting this folder on the
daemons' PYTHONPATH."""

from __future__ import annotations

import os

from torch import nn

from hetps.training.models import BUILTINS

NAN_AFTER = "HETPS_TEST_NAN_AFTER"


class NanAfter(nn.Module):
    def __init__(self, inner: nn.Module, after: int | None):
        super().__init__()
        self.inner = inner
        self.after = after
        self.forwards = 0  # training forward passes so far

    def forward(self, x):
        out = self.inner(x)
        if self.training and self.after is not None:
            self.forwards += 1
            if self.forwards > self.after:
                out = out * float("nan")
        return out


def lenet5_nan_when_told(input_shape, num_classes):
    after = os.environ.get(NAN_AFTER)
    return NanAfter(BUILTINS["lenet5"](input_shape, num_classes), int(after) if after else None)
