"""Run metrics: JSON lines and TensorBoard events, the final summary and the curves plot.

A run's metrics are *records* ``{"step": int, "split": str, <metric>: float, ...}``: split
``"train"`` for training windows (means over the steps since the previous record), one split
per held-out set (MQAR: one per ``(seq_len, pairs)`` setting), and with ``plasticity.every``
split ``"plasticity"``: the alignment figures ``<level>/<figure>`` of the fast levels' updates
(:func:`nested.run.pieces.make_alignment_fn`). They are appended to
``<workdir>/metrics.jsonl`` and mirrored as TensorBoard scalars ``<split>/<metric>`` under
``<workdir>/tensorboard``. Wall-clock quantities (:data:`TIMING_KEYS`) are kept apart from
the rest, which a resumed run reproduces exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and no GUI backend probing

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboardX import SummaryWriter  # noqa: E402

from nested import files

TIMING_KEYS = ("tokens_per_s", "seconds")
CHECKS_PREFIX = "finite/"  # per-step health flags (nested.core.guards): checked, not logged
TRAIN = "train"
PLASTICITY = "plasticity"
NOT_EVALUATIONS = (TRAIN, PLASTICITY)  # splits that are not held-out sets
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
# Curves worth a panel, in order; a panel appears when some record has the metric.
PLOTTED = ("loss", "accuracy", "bpc", "in_context_accuracy", "memory_accuracy")
SUMMARIZED = ("accuracy", "in_context_accuracy", "memory_accuracy", "bpc", "loss")


def read(workdir: str | Path) -> list[dict]:
    """The records of ``<workdir>/metrics.jsonl`` (empty if there is none)."""
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricWriter:
    """Appends records to ``metrics.jsonl`` and TensorBoard.

    ``resume_step``: the step a resumed run continues from; records after it (written by the
    interrupted run after its last checkpoint) are dropped from the JSON lines, and
    TensorBoard is told to purge its events after it, so both hold one history.
    ``write=False`` (processes other than 0 of a multi-process run): records are made and
    returned, nothing is written.
    """

    def __init__(self, workdir: str | Path, *, resume_step: int | None = None, write: bool = True):
        workdir = Path(workdir)
        self.path = workdir / METRICS_FILE
        self.tensorboard = None
        if not write:
            return
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read(workdir) if r["step"] <= resume_step]
            # Replaced in one rename: a run killed here keeps its history.
            files.write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        purge = None if resume_step is None else resume_step + 1
        self.tensorboard = SummaryWriter(str(workdir / "tensorboard"), purge_step=purge)

    def write(self, step: int, split: str, values: Mapping[str, float]) -> dict:
        record = {"step": int(step), "split": split, **{k: float(v) for k, v in values.items()}}
        if self.tensorboard is None:
            return record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for name, value in values.items():
            self.tensorboard.add_scalar(f"{split}/{name}", float(value), int(step))
        return record

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def mean(values: Iterable[Mapping[str, float]], weights: Iterable[float] | None = None) -> dict:
    """Weighted mean of metric dicts (equal weights by default), in float64."""
    values = list(values)
    w = np.ones(len(values)) if weights is None else np.asarray(list(weights), np.float64)
    total = max(float(w.sum()), 1e-30)
    return {
        k: float(sum(wi * float(v[k]) for wi, v in zip(w, values, strict=True)) / total)
        for k in values[0]
    }


def final_eval(records: list[dict]) -> dict[str, dict]:
    """``{split: record}`` of the last evaluation (the latest step with eval records)."""
    evals = [r for r in records if r["split"] not in NOT_EVALUATIONS]
    if not evals:
        return {}
    last = max(r["step"] for r in evals)
    return {r["split"]: r for r in evals if r["step"] == last}


def skipped(records: Iterable[Mapping]) -> int | None:
    """The steps the training records count as skipped (non-finite); None where they count
    none (``train.skip_nonfinite=False``)."""
    counted = [r["skipped"] for r in records if r["split"] == TRAIN and "skipped" in r]
    return int(sum(counted)) if counted else None


def summary(records: list[dict]) -> dict:
    """The headline numbers of a run: the final eval per split, their means over splits
    (``accuracy``; ``bpc`` for language modelling) and, where steps were skipped as
    non-finite (``train.skip_nonfinite=True``), their count, ``skipped_steps``."""
    final = final_eval(records)
    out = {"step": max((r["step"] for r in final.values()), default=0), "splits": final}
    if (count := skipped(records)) is not None:
        out["skipped_steps"] = count
    for name in ("accuracy", "bpc", "loss"):
        values = [r[name] for r in final.values() if name in r]
        if values:
            out[f"mean_{name}"] = float(np.mean(values))
    return out


def format_summary(result: Mapping) -> str:
    """The printed summary: one line per split, then the headline."""
    splits = result["splits"]
    if not splits:
        return "no evaluation was run"
    names = [n for n in SUMMARIZED if any(n in r for r in splits.values())]
    lines = [f"final evaluation at step {result['step']}:"]
    width = max(len(s) for s in splits)
    for split, record in splits.items():
        cells = "  ".join(f"{n}={record[n]:.4f}" for n in names if n in record)
        lines.append(f"  {split:<{width}}  {cells}")
    if "mean_bpc" in result:
        lines.append(f"final test bpc: {result['mean_bpc']:.4f}")
    elif "mean_accuracy" in result:
        lines.append(
            f"final test accuracy: {result['mean_accuracy']:.4f} (mean over {len(splits)} splits)"
        )
    if "skipped_steps" in result:
        lines.append(
            f"skipped steps: {result['skipped_steps']} of {result['step']} (non-finite values)"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Training and eval curves, one panel per metric of :data:`PLOTTED`, one line per split,
    and with plasticity records one of each level's mean ``cos_local``; saved as a PNG at
    ``path``."""
    cosines = sorted(
        {k for r in records if r["split"] == PLASTICITY for k in r} - {"step", "split"}
    )
    cosines = [k for k in cosines if k.endswith("/cos_local")]
    panels = [m for m in PLOTTED if any(m in r for r in records)] + cosines
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 3.8))
    axes = np.atleast_1d(axes)
    splits = list(dict.fromkeys(r["split"] for r in records))
    for ax, metric in zip(axes, panels, strict=False):
        for split in [PLASTICITY] if metric in cosines else splits:
            points = [
                (r["step"], r[metric]) for r in records if r["split"] == split and metric in r
            ]
            if points:
                steps, values = zip(*points, strict=True)
                style = {"lw": 1.0, "alpha": 0.8} if split == TRAIN else {"marker": "o", "ms": 3}
                ax.plot(steps, values, label=split, **style)
        ax.set_xlabel("step")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
        if metric == "loss":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
