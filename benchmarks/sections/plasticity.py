"""The "Functional plasticity" section: models of ``configs/continual.py`` of equal
slow-parameter count trained, then deployed on held-out agents by ``experiments/plasticity.py``
(its ``plasticity.json``): the continual-learning matrix, forgetting and regret utility; and
the alignment of TTT-style levels at initialisation and after training."""

from __future__ import annotations

import numpy as np

from sections import text
from sections.rows import Row, Runs, Section

SCRIPT = "experiments/plasticity.py"
RESULT = "plasticity.json"
# Phases of 4 sessions of 2 sequences per task, regret sessions of 2.
MODELS = ("one_level", "two_level", "hope")
FLAGS = ("--sessions=4", "--session_length=2", "--cycles=3")
ALIGNMENT_RULES = ("ttt_linear", "ttt_mlp")  # TTT-style levels, at initialisation and trained
METRIC = "memory_accuracy"


def rows() -> list[Row]:
    out = []
    for variant in MODELS:
        config = f"configs/continual.py:{variant}"
        out.append(Row(f"plasticity/{variant}", config, after=(SCRIPT, *FLAGS)))
    for rule in ALIGNMENT_RULES:
        config = f"configs/mqar.py:{rule}"
        out.append(Row(f"plasticity/{rule}", config, after=(SCRIPT, "--protocols=alignment")))
    return out


def _ci(figures: dict, mask) -> str:
    """Mean utility over the ``mask``ed (A, B) pairs, with the mean of their interval ends."""
    mean = lambda key: float(np.mean(np.array(figures[key], dtype=float)[mask]))
    return f"{mean('utility'):.2f} [{mean('low'):.2f}, {mean('high'):.2f}]"


def _row(values) -> str:
    return "[" + ", ".join(f"{100 * v:.1f}" for v in values) + "]"


def transfer_table(models: dict) -> tuple[list[str], list[str]]:
    """The models' table of transfer and regret, and their R matrices."""
    head = ["model", "ACC", "BWT", "FWT", "forgetting (max)", "forgetting (first-last)", "LCA"]
    head += ["U fast, same task", "U fast, other tasks", "U slow, same task", "U slow, other"]
    lines, matrices = text.head(head), []
    for row_id, (record, result) in models.items():
        name = row_id.removeprefix("plasticity/")
        failed = text.failed(record, result, RESULT)
        if failed:
            lines.append(text.failed_row(name, failed, len(head)))
            continue
        summary = result["transfer"]["summary"][METRIC]
        keys = ("average_accuracy", "backward_transfer", "forward_transfer", "forgetting_max")
        keys += ("forgetting_first_last", "learning_curve_area")
        cells = [text.pct(summary.get(k)) for k in keys]
        for kind in ("fast", "slow"):
            figures = result["regret"][kind]
            same = np.eye(len(figures["utility"]), dtype=bool)
            cells += [_ci(figures, same), _ci(figures, ~same)]
        lines.append(text.row([name, *cells]))
        R = np.array(result["transfer"]["R"][METRIC], dtype=float)
        b = np.array(result["transfer"]["b"][METRIC], dtype=float)
        after = zip(result["transfer"]["tasks"], R, strict=True)
        matrices.append(
            f"* {name}: before any phase {_row(b)}; "
            + "; ".join(f"after task {t} {_row(r)}" for t, r in after)
        )
    return lines, matrices


def alignment_table(results: dict) -> list[str]:
    head = ["level", "form", "cos(grad J, g) trained", "initial", "conflict rate trained"]
    head += ["initial", "total update trained", "initial", "command"]
    lines = text.head(head)
    for row_id, (record, result) in results.items():
        name = row_id.removeprefix("plasticity/")
        failed = text.failed(record, result, RESULT)
        failed = failed or (result["alignment"].get("error") and "**failed**")
        if failed:
            lines.append(text.failed_row(name, failed, len(head)))
            continue
        for form in ("through_scan", "one_step"):
            trained = result["alignment"]["trained"][form]["levels"]["memory"]
            initial = result["alignment"]["initial"][form]["levels"]["memory"]
            cells = [
                f"{trained['cos_local']:.4f}",
                f"{initial['cos_local']:.4f}",
                f"{trained['conflict_local']:.2f}",
                f"{initial['conflict_local']:.2f}",
                f"{trained['total_update']:.3g}",
                f"{initial['total_update']:.3g}",
            ]
            lines.append(text.row([name, form, *cells, text.commands(record)]))
    return lines


def render(runs: Runs) -> str:
    measured = {k: (r, runs.json(k, RESULT)) for k, (r, _) in runs.rows("plasticity/").items()}
    name = lambda row_id: row_id.removeprefix("plasticity/")
    models = {k: v for k, v in measured.items() if name(k) in MODELS}
    aligned = {k: v for k, v in measured.items() if name(k) in ALIGNMENT_RULES}
    table, matrices = transfer_table(models)
    commands = [f"* {name(k)}: {text.commands(record)}" for k, (record, _) in models.items()]
    return text.fill(
        text.parts("plasticity")["section"],
        table=table,
        matrices=matrices,
        commands=commands,
        alignment=alignment_table(aligned),
    )


SECTIONS = (Section("plasticity", text.title("plasticity"), render),)
