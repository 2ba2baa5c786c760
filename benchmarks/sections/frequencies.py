"""The four "Multi-frequency memory" sections, one per stream of the continual task
(:data:`STREAMS`): one level against two (a fast and a slow head of one layer, the slow one
learning the same stream or consolidating the fast one) at equal slow parameters and carried
bytes, three levels, and Hope with its memory carried, over seeds of training; each deployed
by ``experiments/plasticity.py --protocols=transfer``. Where measured, the level ablation
(``plasticity_reset_<level>.json``) and the alignment over a task switch
(``plasticity_switch.json``) of the first seed."""

from __future__ import annotations

import dataclasses
import shutil
from functools import partial

import numpy as np

from nested.plasticity import transfer
from nested.run import config as nc
from sections import plasticity, text
from sections.rows import Row, Runs, Section

MODELS = (
    "one_level",
    "one_level_wide",
    *(f"{kind}_1_{period}" for kind in ("periods", "consolidate") for period in (8, 32, 128)),
    "one_level_wider",
    "three_level",
    "hope_carried",
)
SEEDS = (0, 1, 2)
FLAGS = ("--sessions=4", "--session_length=2", "--protocols=transfer")
# The same comparison on a stream where retention can pay: every task its own 32 keys (tokens
# 1..128 of a vocabulary of 288), so no later task changes an earlier task's answers.
DISJOINT_MODELS = (
    "one_level",
    "one_level_wide",
    "periods_1_32",
    "consolidate_1_32",
    "consolidate_1_128",
    "one_level_wider",
    "three_level",
)
DISJOINT = (("task.disjoint_keys", True), ("task.remap_fraction", 1.0), ("task.vocab_size", 288))
# And with half the training queries on the earlier tasks' keys of the agent (review), so
# the training loss rewards keeping them; with the slow head's step size fixed (`_lr<value>`:
# `levels.slow.lr`) instead of the gate the outer loop learns.
REVIEW = (*DISJOINT, ("task.review_queries", 4))
FIXED_SLOW_LR = tuple(f"consolidate_1_32_lr{lr}" for lr in (0.03, 0.1, 0.3, 1.0))
# And at a load one head can hold: 8 keys a task (32 pairs over the four tasks, what a 32 x 32
# head stores without interference), 4 of them presented a sequence: is the forgetting a matter
# of capacity, or do the learned gates discard what would fit?
LOAD_MODELS = ("one_level", "one_level_wide", "periods_1_32", "consolidate_1_32")
LOAD = (*DISJOINT, ("task.num_keys", 8), ("task.num_pairs", 4))
STREAMS = {  # stream (its section's name): (models, overrides, training seeds)
    "frequencies": ((*MODELS, *FIXED_SLOW_LR), (), SEEDS),
    "frequencies_disjoint": (DISJOINT_MODELS, DISJOINT, SEEDS),
    "frequencies_review": ((*DISJOINT_MODELS, *FIXED_SLOW_LR), REVIEW, SEEDS[:1]),
    "frequencies_load": (LOAD_MODELS, LOAD, SEEDS),
}
METRIC = "memory_accuracy"
SWITCH_FIGURE = "benchmarks/figures/{stream}_switch.png"  # committed beside RESULTS.md


def _variant(model: str) -> tuple[str, tuple]:
    """A model name's config variant and overrides: ``X_lr<value>`` is ``X`` with its slow
    head's step size fixed at the value."""
    variant, _, lr = model.partition("_lr")
    return variant, ((("levels.slow.lr", float(lr)),) if lr else ())


def rows() -> list[Row]:
    out = []
    for stream, (models, overrides, seeds) in STREAMS.items():
        for seed in seeds:
            for model in models:
                variant, fixed = _variant(model)
                out.append(
                    Row(
                        f"{stream}/{model}/seed{seed}",
                        f"configs/continual.py:{variant}",
                        (("seed", seed), *overrides, *fixed),
                        after=(plasticity.SCRIPT, *FLAGS),
                    )
                )
    return out


def _by_model(runs: Runs, stream: str) -> dict[str, list[tuple[dict, dict | None]]]:
    """``{model: [(row record, plasticity.json or None) per seed]}`` of a stream's rows, in
    the stream's order of models."""
    out: dict[str, list] = {}
    for row_id, (record, _) in runs.rows(f"{stream}/").items():
        result = runs.json(row_id, plasticity.RESULT)
        out.setdefault(row_id.split("/")[1], []).append((record, result))
    return {m: out[m] for m in STREAMS[stream][0] if m in out}


def _over_seeds(values: list[float], spread: bool = True) -> str:
    """Mean over seeds in %, with the range over seeds."""
    if not values:
        return "—"
    mean = f"{100 * float(np.mean(values)):.1f}"
    if not spread or len(values) < 2:
        return mean
    return f"{mean} [{100 * min(values):.1f}, {100 * max(values):.1f}]"


def _tracking(settings: dict, overrides) -> np.ndarray:
    """The continual stream's tracking matrix (``transfer.tracking_matrix``) over the held-out
    agents ``experiments/plasticity.py`` deploys with ``settings``, the stream's task fields
    set by the ``task.`` overrides."""
    task = nc.build(nc.load("configs/continual.py:one_level")).task
    fields = {k.removeprefix("task."): v for k, v in overrides if k.startswith("task.")}
    task = dataclasses.replace(task, seed=task.seed + settings["agent_seed"], **fields)
    rows_, tasks = range(settings["batch_size"]), range(task.num_tasks)
    mappings = [[task.mapping(j, r, -1) for j in tasks] for r in rows_]
    return transfer.tracking_matrix(mappings, [task.keys(j) for j in tasks])


def _kept(R: np.ndarray, A: np.ndarray) -> float:
    """Accuracy on earlier tasks beyond what their unchanged keys explain: the mean over
    ``i > j`` of ``R[i, j] - A[i, j] R[j, j]``, answers only a memory of old values gives."""
    below = np.tril(np.ones_like(R, dtype=bool), -1)
    return float(np.mean((R - A * np.diag(R)[None, :])[below]))


def _later(values) -> str:
    return " / ".join(f"{100 * v:.1f}" for v in values)


def _table(models: dict, A: np.ndarray | None) -> tuple[list[str], list[str], list[str], dict]:
    """The table of a stream's models (``_by_model``) with the ideal tracker's row (``A`` its
    matrix; None: no row measured), the per-seed intervals, the commands, and ``{model:
    (ACC, BWT)}`` mean over seeds. "train wall": the training command's wall time, mean over
    the seeds."""
    head = ["model", "slow params", "carried bytes", "seeds", "train wall", "ACC", "BWT", "FWT"]
    head += ["forgetting (max)", "old values kept", "in-context ACC"]
    head += ["task 0 after 1 / 2 / 3 later tasks"]
    lines = text.head(head)
    if A is not None:
        ideal = transfer.summary(A, np.zeros(len(A)))
        cells = ["current-mapping tracker (ideal)", "", "", "", ""]
        cells += [f"{100 * ideal[k]:.1f}" for k in ("average_accuracy", "backward_transfer")]
        cells += [f"{100 * ideal['forward_transfer']:.1f}", f"{100 * ideal['forgetting_max']:.1f}"]
        lines.append(text.row([*cells, "0.0", "", _later(A[1:, 0])]))
    details, commands, figures = [], [], {}
    parts = text.parts("frequencies")
    for model, seeds in models.items():
        done = [result for _, result in seeds if result is not None and "transfer" in result]
        walls = [record["wall_s"] for record, r in seeds if r is not None and "transfer" in r]
        failed = [
            text.failed(r, result, plasticity.RESULT) for r, result in seeds if result is None
        ]
        if not done:
            lines.append(text.failed_row(model, failed[0] if failed else "—", len(head)))
            continue
        spent = done[0]["budget"]
        summaries = [r["transfer"]["summary"][METRIC] for r in done]
        get = lambda key, summaries=summaries: [s[key] for s in summaries]
        in_context = [r["transfer"]["summary"]["in_context_accuracy"] for r in done]
        R = [np.array(r["transfer"]["R"][METRIC], dtype=float) for r in done]
        figures[model] = tuple(
            float(np.mean(get(k))) for k in ("average_accuracy", "backward_transfer")
        )
        cells = [
            model,
            f"{spent['slow_parameters']:,}",
            f"{spent['carried_bytes']:,}",
            str(len(done)),
            f"{np.mean(walls):.0f} s",
            _over_seeds(get("average_accuracy")),
            _over_seeds(get("backward_transfer")),
            _over_seeds(get("forward_transfer"), spread=False),
            _over_seeds(get("forgetting_max"), spread=False),
            _over_seeds([_kept(r, A) for r in R]),
            _over_seeds([s["average_accuracy"] for s in in_context]),
            _later(np.mean([r[1:, 0] for r in R], axis=0)),
        ]
        lines.append(text.row(cells))
        intervals = [
            r["transfer"]["intervals"][METRIC].get("backward_transfer")
            for r in done
            if r["transfer"].get("intervals", {}).get(METRIC)
        ]
        if intervals:
            each = "; ".join(
                f"{100 * m:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" for m, lo, hi in intervals
            )
            details.append(parts["intervals"].substitute(model=model, intervals=each))
        others = ", ".join(f"`{k}`" for k in range(1, len(seeds)))
        more = " " + parts["others"].substitute(seeds=others) if len(seeds) > 1 else ""
        commands.append(f"* {model}: {text.commands(seeds[0][0])}{more}")
    return lines, details, commands, figures


def _against(part, figures: tuple[float, float], base: tuple[float, float], **fields) -> str:
    """A verdict of the template ``part``: a model's (ACC, BWT) against the ``base``'s."""
    (acc, bwt), (acc0, bwt0) = figures, base
    points = lambda x: f"{100 * x:.1f}"
    return part.substitute(
        bwt=points(bwt),
        base_bwt=points(bwt0),
        gain=f"{100 * (bwt - bwt0):+.1f}",
        acc=points(acc),
        base_acc=points(acc0),
        **fields,
    )


def _verdicts(figures: dict) -> tuple[list[str], str | None]:
    """The verdicts on the two-level models against ``one_level_wide`` and on three levels
    against ``one_level_wider`` (where both were measured), and the two-level model of best
    BWT (None without one)."""
    parts, out, best = text.parts("frequencies"), [], None
    base = figures.get("one_level_wide")
    multi = {m: f for m, f in figures.items() if m.startswith(("periods_", "consolidate_"))}
    if base and multi:
        best = max(multi, key=lambda m: multi[m][1])
        out.append(_against(parts["two_level"], multi[best], base, model=best))
    if "three_level" in figures and "one_level_wider" in figures:
        out.append(
            _against(parts["three_level"], figures["three_level"], figures["one_level_wider"])
        )
    return out, best


def _first_seed(runs: Runs, stream: str, model: str, name: str) -> dict | None:
    return runs.json(f"{stream}/{model}/seed{SEEDS[0]}", name)


def _ablation(runs: Runs, models, stream: str) -> str:
    """Where retention lives: the first seed of each multi-level model of ``stream`` deployed
    again with one level restarted after every phase (``plasticity_reset_<level>.json``, when
    measured)."""
    lines = []
    for model in models:
        for level in ("memory", "mid", "slow"):
            result = _first_seed(runs, stream, model, f"plasticity_reset_{level}.json")
            if result is None:
                continue
            summary = result["transfer"]["summary"][METRIC]
            cells = [text.pct(summary[k]) for k in ("average_accuracy", "backward_transfer")]
            lines.append(text.row([model, level, *cells]))
    if not lines:
        return ""
    ablation = text.parts("frequencies")["ablation"]
    return text.fill(ablation, run=f"runs/results/{stream}/MODEL/seed0", table=lines)


def _switch(runs: Runs, models, stream: str, shown: str | None) -> str:
    """Per-level alignment over a task switch of the first seed of each model of ``stream``
    measured by the alignment protocol (``plasticity_switch.json``), and the figure of
    ``shown`` (the best two-level model; else the first measured) copied to
    :data:`SWITCH_FIGURE` of the stream."""
    lines, plots = [], {}
    for model in models:
        result = _first_seed(runs, stream, model, "plasticity_switch.json")
        switch = None if result is None else result["alignment"].get("switch")
        if switch is None:
            continue
        for level, old in switch["old_task"]["levels"].items():
            new = switch["new_task"]["levels"][level]
            shown_as = lambda key, spec: [  # None: the level made no update in the batch
                "—" if f[key] is None else format(f[key], spec) for f in (new, old)
            ]
            cells = shown_as("cos_update", ".3f") + shown_as("total_update", ".3g")
            cells += shown_as("conflict_update", ".2f")
            lines.append(text.row([model, level, *cells]))
        png = runs.workdir / stream / model / f"seed{SEEDS[0]}" / "plasticity_switch.png"
        if png.exists():
            plots[model] = png
    if not lines:
        return ""
    shown = shown if shown in plots else next(iter(plots), None)
    parts = text.parts("frequencies")
    figure = ""
    if shown is not None:
        path = SWITCH_FIGURE.format(stream=stream)
        (runs.page / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plots[shown], runs.page / path)
        figure = text.fill(parts["switch_figure"], model=shown, path=path)
    run = f"runs/results/{stream}/MODEL/seed0"
    return text.fill(parts["switch"], run=run, table=lines, figure=figure)


def render(runs: Runs, stream: str) -> str:
    """A stream's section: its introduction, the table of its rows with the verdicts and the
    seeds' intervals, the level ablation, the alignment over a task switch and the commands
    (empty until one of its rows is measured)."""
    models = _by_model(runs, stream)
    if not models:
        return ""
    settings = next((r["settings"] for m in models.values() for _, r in m if r is not None), None)
    A = None if settings is None else _tracking(settings, STREAMS[stream][1])
    table, details, commands, figures = _table(models, A)
    verdicts, best = _verdicts(figures)
    parts = text.parts("frequencies")
    flags = " ".join(f"`--config.{k}={v}`" for k, v in DISJOINT)
    return text.fill(
        parts["section"],
        intro=parts[stream].substitute(disjoint_flags=flags),
        table=table,
        verdicts="\n\n".join(verdicts),
        details=details,
        ablation=_ablation(runs, models, stream),
        switch=_switch(runs, models, stream, best),
        commands=commands,
    )


SECTIONS = tuple(
    Section(stream, text.title("frequencies", stream), partial(render, stream=stream))
    for stream in STREAMS
)
