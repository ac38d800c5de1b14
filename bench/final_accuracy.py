"""Final test accuracy per seed, one column per algorithm, of a
`hetps compare` output folder: for comparisons whose only evaluation is the
final one (e.g. a single final average, `algorithm.period_s: 0`), where
compare.png's curves have one point.

    .venv/bin/python bench/final_accuracy.py runs/sim-wpsgd8 docs/img/sim-wpsgd8.png

Reads OUT/compare.json (the algorithms, in order) and OUT/LABEL-N/summary.json;
writes the PNG and prints one line per algorithm.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from hetps.frontend.plots import pyplot_agg


def final_accuracies(out: Path) -> dict[str, list[float]]:
    """Algorithm label -> the final accuracy of each repeat (in seed order)."""
    labels = [row["algorithm"] for row in json.loads((out / "compare.json").read_text())]

    def seed_order(path: Path) -> int:
        return int(path.parent.name.rsplit("-", 1)[1])

    return {
        label: [
            json.loads(p.read_text())["final_accuracy"] or 0.0
            for p in sorted(out.glob(f"{label}-*/summary.json"), key=seed_order)
        ]
        for label in labels
    }


def main(out: Path, png: Path) -> None:
    runs = final_accuracies(out)
    plt = pyplot_agg()
    fig, ax = plt.subplots(figsize=(5, 4))
    for x, (label, accs) in enumerate(runs.items()):
        ax.scatter([x] * len(accs), accs, zorder=3)
        for seed, acc in enumerate(accs):
            ax.annotate(
                f"seed {seed}", (x, acc), textcoords="offset points", xytext=(6, -3), fontsize=8
            )
        ax.hlines(statistics.median(accs), x - 0.2, x + 0.2, colors="black")
        print(f"{label}: median {statistics.median(accs):.3f}, per seed {accs}")
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_xlim(-0.5, len(runs) - 0.5)
    ax.set_ylabel("final test accuracy (line: median)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
