"""The "MQAR at Zoology's settings" section: ``configs/mqar.py:zoology-<rule>`` (Zoology's
figure 2: vocabulary 8192, (sequence, pairs) (64, 4), (128, 8), (256, 16), two layers) for
each rule of :data:`RULES` at each width of :data:`WIDTHS` and learning rate of :data:`LRS`,
over :data:`SEEDS`; per (rule, width) the best learning rate (:func:`best_lrs`) with its
seeds' mean and 95% interval, the sweep, and accuracy against width in the shape of Zoology's
figure 2 (:data:`FIGURE`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
from scipy import stats

from nested.run import metrics
from sections import plots, text
from sections.rows import Row, Runs, Section

PREFIX = "mqar_zoology/"
# The neural memories do not fit the hour beside these: at width 64, batch 16, a step takes
# 0.8-0.9 CPU-seconds here for these three, 1.0 for ttt_mlp, 1.4 for titans, 3.1 for hope.
RULES = ("attention", "delta", "gated_delta")
WIDTHS = (64, 128)
LRS = (1e-3, 3e-3, 1e-2)  # Zoology's figure 2 sweeps np.logspace(-4, -2, 4)
SEEDS = (0, 1)
SWEEP_SEED = 0  # the seed the best learning rate is chosen on
# Zoology trains 25,000 steps of 256 sequences (configs/mqar.py's zoology defaults)
CPU = (
    ("train.steps", 50),
    ("train.batch_size", 16),
    ("optimizer.warmup_steps", 5),
    ("train.eval_every", 50),
    ("train.checkpoint_every", 50),
    ("train.eval_batches", 1),
)
CPU_NOTE = (
    "50 steps of 16 sequences instead of 25,000 of 256 (800 training sequences, 0.0125% of "
    "Zoology's 6.4M), a warmup of 5 steps, 250 test sequences a setting instead of 3,000"
)
SWEEP = f"python benchmarks/results.py --sections=mqar_zoology --only='^{PREFIX}.*/seed0$'"
FIGURE = "benchmarks/figures/mqar_zoology.png"  # committed beside RESULTS.md
_ID = re.compile(r"(?P<rule>.+)_d(?P<dim>\d+)_lr(?P<lr>[^/]+)/seed(?P<seed>\d+)")


def _run(rule: str, dim: int, lr: float) -> str:
    return f"{rule}_d{dim}_lr{lr:g}"


def row_id(rule: str, dim: int, lr: float, seed: int) -> str:
    return f"{PREFIX}{_run(rule, dim, lr)}/seed{seed}"


def rows() -> list[Row]:
    """Seed by seed (the sweep's seed first), every rule, width and learning rate."""
    return [
        Row(
            row_id(rule, dim, lr, seed),
            f"configs/mqar.py:zoology-{rule}",
            (("seed", seed), ("model.dim", dim), ("optimizer.learning_rate", lr), *CPU),
            CPU_NOTE,
        )
        for seed in SEEDS
        for rule in RULES
        for dim in WIDTHS
        for lr in LRS
    ]


def _sweep(runs: Runs) -> dict[tuple[str, int], dict[float, dict[int, tuple[dict, list]]]]:
    """``{(rule, dim): {lr: {seed: (row.json, metrics records)}}}`` of the rows run."""
    out: dict = {}
    for row, result in runs.rows(PREFIX).items():
        found = _ID.fullmatch(row.removeprefix(PREFIX))
        key, lr, seed = (found["rule"], int(found["dim"])), float(found["lr"]), int(found["seed"])
        out.setdefault(key, {}).setdefault(lr, {})[seed] = result
    return out


def _failed(result: tuple[dict, list]) -> str | None:
    """None for a row with final evaluations, else why it has none."""
    record, records = result
    return text.outcome(record, metrics.final_eval(records))


def _mean(result: tuple[dict, list]) -> float | None:
    """The mean test accuracy over the settings of a finished row; None where it failed."""
    return None if _failed(result) else metrics.summary(result[1])["mean_accuracy"]


def best_lrs(sweep: dict) -> dict[tuple[str, int], float]:
    """Per (rule, width), the learning rate whose :data:`SWEEP_SEED` row has the highest mean
    test accuracy (the smaller one on a tie), as Zoology reports the best of its sweep; a
    (rule, width) without a finished row of that seed has none."""
    best = {}
    for key, lrs in sweep.items():
        means = {lr: _mean(seeds[SWEEP_SEED]) for lr, seeds in lrs.items() if SWEEP_SEED in seeds}
        means = {lr: m for lr, m in means.items() if m is not None}
        if means:
            best[key] = max(means, key=lambda lr: (means[lr], -lr))
    return best


def seeds_command(best: dict[tuple[str, int], float]) -> str:
    """The command running the seeds other than :data:`SWEEP_SEED` at the ``best`` rates."""
    runs = "|".join(re.escape(_run(*key, lr)) for key, lr in best.items())
    return f"python benchmarks/results.py --sections=mqar_zoology --only='^{PREFIX}({runs})/'"


def _needed(best: dict[tuple[str, int], float]) -> list[str]:
    """The rows the section's numbers need (ids less :data:`PREFIX`): the sweep's, and every
    seed at the ``best`` rates."""
    ids = [r.id.removeprefix(PREFIX) for r in rows()]
    runs = {_run(*key, lr) for key, lr in best.items()}
    return [i for i in ids if i.endswith(f"/seed{SWEEP_SEED}") or i.split("/")[0] in runs]


def interval(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half-width of its 95% Student-t interval over them
    (``t_{0.975, n-1} s / sqrt(n)``; None for a single value)."""
    n, mean = len(values), float(np.mean(values))
    if n < 2:
        return mean, None
    return mean, float(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n))


def _pct(value: float) -> str:
    """A percentage to a hundredth: chance, one value of 4096, is 0.02%."""
    return f"{100 * value:.2f}"


def _shown(mean: float, half: float | None) -> str:
    if half is None:
        return _pct(mean)
    low, high = max(mean - half, 0.0), min(mean + half, 1.0)
    return f"{_pct(mean)} [{_pct(low)}, {_pct(high)}]"


def _points(sweep: dict, best: dict) -> dict[tuple[str, int], dict]:
    """Per (rule, width) with a best learning rate: the finished seeds' results at it, ``lr``,
    per setting and for the mean ``(mean, half-width)`` over those seeds."""
    out = {}
    for key, lr in best.items():
        done = [r for r in sweep[key][lr].values() if _mean(r) is not None]
        finals = [metrics.final_eval(records) for _, records in done]
        splits = {s: interval([f[s]["accuracy"] for f in finals]) for s in finals[0]}
        mean = interval([_mean(r) for r in done])
        out[key] = dict(lr=lr, seeds=done, splits=splits, mean=mean)
    return out


def best_table(points: dict) -> list[str]:
    splits = list(next(iter(points.values()))["splits"]) if points else []
    head = ["rule", "dim", "best lr", "seeds", *splits, "mean [95%]", "wall", "command"]
    lines = text.head(head)
    for (rule, dim), point in points.items():
        walls = [record["wall_s"] for record, _ in point["seeds"]]
        cells = [rule, str(dim), f"{point['lr']:g}", str(len(point["seeds"]))]
        cells += [_pct(point["splits"][s][0]) for s in splits]
        cells += [_shown(*point["mean"]), f"{np.mean(walls):.0f} s"]
        lines.append(text.row([*cells, text.cmd(point["seeds"][0][0])]))
    return lines


def sweep_table(sweep: dict, best: dict) -> list[str]:
    """Seed :data:`SWEEP_SEED`'s mean test accuracy per learning rate, the best in bold."""
    lines = text.head(["rule", "dim", *(f"lr {lr:g}" for lr in LRS)])
    for key, lrs in sweep.items():
        cells = []
        for lr in LRS:
            result = lrs.get(lr, {}).get(SWEEP_SEED)
            if result is None or _failed(result):
                cells.append("not run" if result is None else _failed(result))
            else:
                mean = _pct(_mean(result))
                cells.append(f"**{mean}**" if best.get(key) == lr else mean)
        lines.append(text.row([key[0], str(key[1]), *cells]))
    return lines


def plot(runs: Runs, points: dict) -> None:
    """Accuracy against width, one panel per test setting, one line per rule (its best
    learning rate at each width; bars: the 95% interval over seeds), into :data:`FIGURE`."""
    splits = list(next(iter(points.values()))["splits"])
    fig, axes = plots.subplots(1, len(splits), figsize=(3.2 * len(splits), 3), sharey=True)
    for ax, split in zip(np.atleast_1d(axes), splits, strict=True):
        for rule in dict.fromkeys(rule for rule, _ in points):
            dims = sorted(dim for r, dim in points if r == rule)
            means, halves = zip(*(points[rule, dim]["splits"][split] for dim in dims), strict=True)
            bars = [0.0 if h is None else h for h in halves]
            ax.errorbar(dims, means, yerr=bars, marker="o", capsize=3, label=rule)
        ax.set_xscale("log", base=2)
        ax.set_xticks(WIDTHS, [str(w) for w in WIDTHS])
        ax.set_ylim(0, 1)
        length, pairs = re.fullmatch(r"seq(\d+)_kv(\d+)", split).groups()
        ax.set_title(f"sequence length {length}, {pairs} pairs")
        ax.set_xlabel("model dimension")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("accuracy")
    np.atleast_1d(axes)[-1].legend(fontsize=8)
    plots.save(fig, runs.page, FIGURE)


def render(runs: Runs) -> str:
    """The section (empty until one of its rows has run)."""
    sweep = _sweep(runs)
    if not sweep:
        return ""
    best = best_lrs(sweep)
    points = _points(sweep, best)
    parts = text.parts("mqar_zoology")
    figure = ""
    if points:
        plot(runs, points)
        figure = text.fill(parts["figure"], path=FIGURE)
    missing = [r for r in _needed(best) if PREFIX + r not in runs.results]
    return text.fill(
        parts["section"],
        rules=", ".join(f"`{r}`" for r in RULES),
        widths=", ".join(map(str, WIDTHS)),
        lrs=", ".join(f"{lr:g}" for lr in LRS),
        seeds=len(SEEDS),
        sweep_seed=SWEEP_SEED,
        sweep_command=SWEEP,
        seeds_command=seeds_command(best),
        best=best_table(points),
        sweep=sweep_table(sweep, best),
        figure=figure,
        missing=text.fill(parts["missing"], rows=", ".join(f"`{m}`" for m in missing))
        if missing
        else "",
        overrides=text.fill(parts["overrides"], notes=CPU_NOTE),
    )


SECTIONS = (Section("mqar_zoology", text.title("mqar_zoology"), render),)
