"""What the outputs and their docs say (issue 42, item 6): the plot's file name as written,
`hetps compare --help` whole, and docs/own-model.md's confusion-matrix task (eval_sums
returning a tensor) run as printed."""

from __future__ import annotations

import re
import subprocess
import textwrap

import pytest
import torch
from cluster_util import HETPS, REPO

from hetps.frontend.plots import run_plot_name
from hetps.training.task import Classification, evaluate_task


@pytest.mark.parametrize("doc", ["docs/run-directory.md", "docs/simulation.md"])
def test_the_docs_name_the_metric_plot_as_the_run_writes_it(doc):
    text = (REPO / doc).read_text()
    assert "`<metric>_vs_time.png`" in text
    assert run_plot_name("macro_f1") == "macro_f1_vs_time.png"
    # accuracy_vs_time.png is named only as the classification case of <metric>_vs_time.png
    for line in text.splitlines():
        if "accuracy_vs_time.png" in line:
            assert "classification" in line or "<metric>_vs_time.png" in line, line


def test_compare_help_describes_the_command_in_whole_sentences():
    done = subprocess.run(
        [*HETPS, "compare", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    # the description: between the usage and the arguments
    description = done.stdout.split("\n\n")[1]
    said = " ".join(description.split())
    assert said.startswith("`hetps compare`: one experiment under several algorithms")
    assert said.endswith("on the same machine, with the same seeds."), said


def confusion_task_methods() -> str:
    """docs/own-model.md's eval_sums/reduce block that sums a confusion matrix."""
    text = (REPO / "docs" / "own-model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if "confusion" in b and "def reduce" in b)


def test_the_documented_confusion_matrix_task_sums_tensors_over_batches():
    namespace: dict = {"torch": torch, "Classification": Classification}
    body = textwrap.indent(textwrap.dedent(confusion_task_methods()), "    ")
    exec(f"class MacroF1(Classification):\n{body}", namespace)
    task = namespace["MacroF1"](num_classes=3)

    class Fixed(torch.nn.Module):  # predicts what each sample's first feature says
        def forward(self, x):
            return torch.nn.functional.one_hot(x[:, 0].long(), 3).float()

    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2, 0])
    predicted = torch.tensor([0, 1, 1, 1, 2, 0, 2, 0])
    x = predicted.float().unsqueeze(1)
    batches = [(x[:3], labels[:3]), (x[3:], labels[3:])]  # two batches: the matrix summed
    got = evaluate_task(task, Fixed(), batches, "cpu")
    # per class: tp, predicted, true -> f1 = 2 tp / (predicted + true)
    f1 = [2 * 2 / (3 + 3), 2 * 2 / (3 + 2), 2 * 2 / (2 + 3)]
    assert got["macro_f1"] == pytest.approx(sum(f1) / 3)
    assert got["accuracy"] == pytest.approx(6 / 8)
