"""The benchmarks' figures: matplotlib on the Agg backend, one bar chart shape shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a benchmark figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def bar_chart(path: Path, labels: Sequence[str], values: Sequence[float], xlabel: str, title: str = "",
              color: str = "#4c72b0", height: float = 3.0) -> None:
    """A horizontal bar per row (the first row on top), written to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, height))
    ax.barh(list(labels)[::-1], list(values)[::-1], color=color)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    save_figure(fig, path)
