"""The "RULER single needle" section: RULER's ``niah_single_1`` and ``niah_single_2``
(``nested.run.needle``) by context length for the models of the "Language modelling on real
text" section, measured by their rows' ``experiments/eval_lm.py --needle`` (the ``needle`` of
its ``eval_lm.json``); a table of accuracies with Wilson 95% intervals and the plot of accuracy
against length (:data:`FIGURE`), in the shape of RULER's figures."""

from __future__ import annotations

from nested.run import needle
from sections import lm, plots, text
from sections.rows import Runs, Section

FIGURE = "benchmarks/figures/ruler_niah.png"  # committed beside RESULTS.md


def measured(runs: Runs) -> dict[str, tuple[dict, dict]]:
    """``{model: (row.json, eval_lm.json's needle)}`` of the ``lm/`` rows that measured it."""
    out = {}
    for row_id, (record, _) in runs.rows("lm/").items():
        result = runs.json(row_id, lm.RESULT)
        if result and result.get("needle"):
            out[row_id.split("/", 1)[1]] = (record, result["needle"])
    return out


def _lengths(found: dict) -> list[str]:
    return sorted({n for _, r in found.values() for t in r.values() for n in t["lengths"]}, key=int)


def _cell(result: dict | None) -> str:
    if result is None:
        return "—"
    low, high = text.pct(result["low"]), text.pct(result["high"])
    return f"{text.pct(result['accuracy'])} [{low}, {high}]"


def table(found: dict) -> list[str]:
    lengths = _lengths(found)
    lines = text.head(["model", "task", *(f"{int(n) // 1024}K" for n in lengths), "command"])
    for model, (record, result) in found.items():
        for task in needle.TASKS:
            by_length = result.get(task, {}).get("lengths", {})
            cells = [_cell(by_length.get(n)) for n in lengths]
            lines.append(text.row([model, f"`{task}`", *cells, text.commands(record)]))
    return lines


def plot(runs: Runs, found: dict) -> None:
    """Accuracy (%) against context length, a panel per task, a line per model, Wilson 95%
    intervals as bars, into :data:`FIGURE` under the page's directory."""
    fig, axes = plots.subplots(1, len(needle.TASKS), figsize=(9, 3.6), sharey=True)
    for ax, task in zip(axes, needle.TASKS, strict=True):
        for i, (model, (_, result)) in enumerate(found.items()):
            by_length = result.get(task, {}).get("lengths", {})
            lengths = sorted(by_length, key=int)
            acc = [100 * by_length[n]["accuracy"] for n in lengths]
            below = [a - 100 * by_length[n]["low"] for a, n in zip(acc, lengths, strict=True)]
            above = [100 * by_length[n]["high"] - a for a, n in zip(acc, lengths, strict=True)]
            dodge = 2 ** (0.05 * (i - (len(found) - 1) / 2))  # equal points side by side
            x = [int(n) * dodge for n in lengths]
            ax.errorbar(x, acc, yerr=[below, above], marker="o", capsize=3, label=model)
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            [int(n) for n in _lengths(found)], [f"{int(n) // 1024}K" for n in _lengths(found)]
        )
        ax.set_ylim(-5, 105)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[-1].legend(fontsize=8)
    plots.save(fig, runs.page, FIGURE)


def render(runs: Runs) -> str:
    found = measured(runs)
    if not found:
        return ""
    plot(runs, found)
    samples = sorted(
        {r["samples"] for _, v in found.values() for t in v.values() for r in t["lengths"].values()}
    )
    new_tokens = sorted({t["new_tokens"] for _, v in found.values() for t in v.values()})
    return text.fill(
        text.parts("ruler")["section"],
        samples="/".join(map(str, samples)),
        new_tokens="/".join(map(str, new_tokens)),
        steps=lm.STEPS,
        table=table(found),
        path=FIGURE,
    )


SECTIONS = (Section("ruler", text.title("ruler"), render),)
