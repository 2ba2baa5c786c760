"""The sections' figures: matplotlib without a display, and a figure written under the page's
directory (linked from the page by the same relative path)."""

from __future__ import annotations

from pathlib import Path


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` on the Agg backend (no display): ``(fig, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig, page: Path, path: str) -> None:
    """Write ``fig`` (laid out tight, 110 dpi) to ``page / path``, then close it."""
    import matplotlib.pyplot as plt

    out = page / path
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
