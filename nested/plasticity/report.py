"""The functional-plasticity report of a trained run (what ``experiments/plasticity.py`` runs).

:func:`run` measures a trained model (:func:`nested.run.loading.load_trained`) deployed on
held-out agents: its task with another seed (``agent_seed``), so every stream's private
mappings are new to it. Protocols (:data:`PROTOCOLS`):

* ``alignment``: :mod:`nested.plasticity.alignment` on a held-out batch, both forms, for the
  trained weights and for the initial weights of the same config (does outer training raise
  the alignment of the local objective with the outer one?), on a later task's batch as ``J``
  where the task has task ids and a level carries its state, the alignment of each level's
  updates over a task switch with the new task's loss and the old task's (:func:`_switch`),
  and the linearisation check of a few updates;
* ``transfer``: the continual-learning matrix (:func:`nested.plasticity.transfer.transfer_matrix`
  over the task ids, or :func:`~nested.plasticity.transfer.windowed_matrix` over windows of a
  stream without them) and its metrics;
* ``regret``: the regret utility, fast and slow (:mod:`nested.plasticity.regret`);
* ``capacity``: the long stream of :func:`nested.plasticity.capacity.long_stream`.

The cross-session protocols need a level that carries its state (``persist="stream"``), and
``regret`` and ``capacity`` task ids. :func:`plot` draws the figures of a result.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nested.plasticity import alignment, capacity, regret, transfer
from nested.plasticity.deployment import (
    HELD_OUT,
    Deployment,
    has_task_ids,
    stream_batches,
    task_batches,
)

PROTOCOLS = ("alignment", "transfer", "regret", "capacity")


class PlasticityError(ValueError):
    """A protocol asked of a run that cannot answer it; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`run` measures and how long (the flags of ``experiments/plasticity.py``)."""

    protocols: tuple[str, ...] = PROTOCOLS
    batch_size: int = 16  # streams (sessions) side by side
    agent_seed: int = 1  # added to the task's seed: held-out agents
    tasks: tuple[int, ...] | None = None  # task ids, in phase order (None: all)
    sessions: int = 3  # sessions per phase
    session_length: int = 2  # batches per session
    eval_batches: int = 2  # held-out batches per evaluation
    windows: int = 4  # streams without task ids: windows of the stream
    window_batches: int = 6  # batches per window (the last eval_batches held out)
    cycles: int = 3  # capacity: passes over the task sequence
    outer_steps: int = 5  # slow regret: outer steps on task A
    learning_rate: float = 1e-3  # slow regret: Adam's step on task A
    linearization: int = 8  # alignment: updates whose removal is checked
    seed: int = 0
    reset_levels: tuple[str, ...] = ()  # transfer: levels restarted after each phase (ablation)


def _held_out_task(task, agent_seed: int):
    return dataclasses.replace(task, seed=task.seed + agent_seed) if hasattr(task, "seed") else task


def check(trained, settings: Settings, *, explicit: bool) -> dict[str, str]:
    """The protocols of ``settings`` this run cannot answer, with why. ``explicit``: the user
    named the protocols, so any of them that cannot run raises :class:`PlasticityError`."""
    unknown = sorted(set(settings.protocols) - set(PROTOCOLS))
    if unknown:
        raise PlasticityError(f"--protocols: {unknown} unknown; allowed: {list(PROTOCOLS)}")
    task = trained.experiment.task
    skipped = {}
    if not trained.experiment.carries_fast:
        why = (
            "no level carries its fast state across sessions (persist='sequence' everywhere); "
            "retrain with --config.levels.<name>.persist=stream"
        )
        skipped.update({p: why for p in ("transfer", "regret", "capacity")})
    if not has_task_ids(task):
        why = f"task {task.name!r} has no task ids (num_tasks, 'task<k>' splits)"
        skipped.update({p: why for p in ("regret", "capacity") if p not in skipped})
    skipped = {p: why for p, why in skipped.items() if p in settings.protocols}
    if explicit and skipped:
        name, why = next(iter(skipped.items()))
        raise PlasticityError(f"--protocols={name}: {why}")
    carried = [lv.name for lv in trained.experiment.system.fast_levels if lv.persist == "stream"]
    strange = [name for name in settings.reset_levels if name not in carried]
    if strange:
        raise PlasticityError(
            f"--reset_levels: {strange} are not levels carried across sessions; allowed: {carried}"
        )
    count = getattr(task, "num_tasks", 0)
    bad = [t for t in settings.tasks or () if not 0 <= t < count]
    if bad:
        raise PlasticityError(f"--tasks: {bad} are not task ids of {task.name!r} (0..{count - 1})")
    return skipped


def run(
    trained,
    settings: Settings = Settings(),
    *,
    explicit: bool = False,
    progress: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Every protocol of ``settings`` on the trained run ``trained`` (a
    :class:`nested.run.loading.Trained`); see the module docstring. Returns a JSON-able dict."""
    skipped = check(trained, settings, explicit=explicit)
    program, params = trained.program, trained.state.params
    task = _held_out_task(trained.experiment.task, settings.agent_seed)
    B = settings.batch_size
    ids = has_task_ids(task)
    tasks = list(settings.tasks or range(getattr(task, "num_tasks", 0)))
    batch_of = task_batches(task, B) if ids else None
    out: dict[str, Any] = {
        "step": trained.step,
        "task": task.name,
        "settings": dataclasses.asdict(settings),
        "skipped": skipped,
    }
    wanted = [p for p in settings.protocols if p not in skipped]
    if "alignment" in wanted:
        out["alignment"] = _alignment(trained, task, tasks, batch_of, settings, progress)
    if set(wanted) & {"transfer", "regret", "capacity"}:
        deployment = Deployment(program, params, B)
    if "transfer" in wanted:
        if ids:
            out["transfer"] = transfer.transfer_matrix(
                deployment,
                batch_of,
                tasks,
                sessions=settings.sessions,
                session_length=settings.session_length,
                eval_batches=settings.eval_batches,
                reset=settings.reset_levels,
                progress=progress,
            )
        else:
            out["transfer"] = transfer.windowed_matrix(
                deployment,
                stream_batches(task, B),
                windows=settings.windows,
                window_batches=settings.window_batches,
                eval_batches=settings.eval_batches,
                progress=progress,
            )
    if "regret" in wanted:
        common = dict(session_length=settings.session_length, progress=progress)
        out["regret"] = {
            "fast": regret.fast_regret(deployment, batch_of, tasks, **common),
            "slow": regret.slow_regret(
                program,
                params,
                batch_of,
                tasks,
                batch_size=B,
                outer_steps=settings.outer_steps,
                learning_rate=settings.learning_rate,
                **common,
            ),
        }
    if "capacity" in wanted:
        out["capacity"] = capacity.long_stream(
            deployment,
            batch_of,
            tasks,
            cycles=settings.cycles,
            sessions=settings.sessions,
            session_length=settings.session_length,
            progress=progress,
        )
    return _jsonable(out)


def _alignment(trained, task, tasks, batch_of, settings: Settings, progress) -> dict[str, Any]:
    """The alignment protocol (module docstring); a model whose levels cannot be probed gets
    ``{"error": why}``."""
    program = trained.program
    B = settings.batch_size
    if batch_of is not None:
        batch, later = (
            batch_of(tasks[0], HELD_OUT),
            batch_of(tasks[min(1, len(tasks) - 1)], HELD_OUT),
        )
    else:
        batch, later = stream_batches(task, B, task.eval_splits[0])(0), None
    batch = _outer(batch)
    fresh = program.init(jax.random.key(settings.seed)).params
    start = jax.jit(lambda params: program.start_fast(params, B))

    @functools.cache
    def compiled(form: str):
        def measure(p, b, f, fu):
            return alignment.measure_program(program, p, b, fast=f, future=fu, form=form)

        return jax.jit(measure)

    def measured(params, form="through_scan", future=None, on=None, fast=None):
        on = batch if on is None else on
        fast = start(params) if fast is None else fast
        J, results = compiled(form)(params, on, fast, future)
        progress()
        return float(J), alignment.to_numpy(results)

    out: dict[str, Any] = {}
    try:
        for name, params in (("trained", trained.state.params), ("initial", fresh)):
            out[name] = {}
            for form in alignment.FORMS:
                J, results = measured(params, form=form)
                out[name][form] = {"J": J, "levels": alignment.summarize(results)}
        carried = trained.experiment.carries_fast and later is not None
        if carried:
            later = _outer(later)
            J, results = measured(trained.state.params, future=later)
            out["later_task"] = {"J": J, "levels": alignment.summarize(results)}
            if len(tasks) > 1:
                old = _outer(batch_of(tasks[0], HELD_OUT + 1))
                out["switch"] = _switch(
                    program, trained.state.params, (batch, later, old), start, measured
                )
        out["linearization"] = _linearization(program, trained.state.params, batch, start, settings)
    except ValueError as error:
        return {"error": " ".join(str(error).split())}
    return out


def _outer(batch) -> dict[str, Any]:
    """The fields of a batch the outer objective reads."""
    return {k: batch[k] for k in ("inputs", "targets", "mask")}


def _switch(program, params, batches, start, measured) -> dict[str, Any]:
    """Alignment over a task switch, ``batches = (first, new, old)``: from the fast state
    ``first`` (a held-out batch of task 0) leaves, each level's updates on ``new`` (the first
    batch of task 1) against that batch's own loss (``new_task``: do they learn it?) and
    against ``old`` (another held-out batch of task 0, new pairs in context) run after it
    (``old_task``: to first order, do they overwrite what the first task left?)."""
    first, new, old = batches
    left = program.loss(params, first, start(params))[1][1]
    primed = program.start_fast(params, first["inputs"].shape[0], left)
    out = {}
    for name, future in (("new_task", None), ("old_task", old)):
        J, results = measured(params, future=future, on=new, fast=primed)
        out[name] = {"J": J, "levels": alignment.summarize(results)}
    return out


def _linearization(program, params, batch, start, settings: Settings) -> dict[str, Any]:
    """Predicted against actual change of ``settings.linearization`` updates drawn at random."""
    fast = start(params)
    loss = lambda p, b, f: alignment.program_loss(program, p, b, f)
    calls = alignment.discover(loss, params, batch, fast)
    rng = np.random.default_rng(settings.seed)
    first = calls[0]
    picks = [
        (
            0,
            int(rng.integers(first.shape[0])),
            int(rng.integers(first.shape[2])),
            int(rng.integers(first.updates)),
        )
        for _ in range(settings.linearization)
    ]
    result = alignment.linearization(loss, params, batch, fast, removals=picks)
    return {"updates": picks, **result}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        return _jsonable(np.asarray(x).tolist())
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _figure(figures: dict, key: str, spec: str) -> str:
    """``figures[key]`` formatted, or "n/a" where it is missing or None (a level that made
    no update in the batch has no direction to compare)."""
    value = figures.get(key)
    return "n/a" if value is None else format(value, spec)


def format_summary(result: dict[str, Any]) -> str:
    """A few lines of the headline figures of a :func:`run` result."""
    lines = []
    align = result.get("alignment", {})
    if "error" in align:
        lines.append(f"alignment: not measured: {align['error']}")
    for name, figures in align.get("trained", {}).get("through_scan", {}).get("levels", {}).items():
        initial = align["initial"]["through_scan"]["levels"].get(name, {})
        lines.append(
            f"alignment {name}: cos(grad J, g) {_figure(figures, 'cos_local', '.3f')} trained "
            f"vs {_figure(initial, 'cos_local', '.3f')} initial; conflict rate "
            f"{_figure(figures, 'conflict_local', '.2f')}; cos(grad J, -delta) "
            f"{_figure(figures, 'cos_update', '.3f')}"
        )
    switch = align.get("switch", {})
    for name, figures in switch.get("old_task", {}).get("levels", {}).items():
        new = switch["new_task"]["levels"][name]
        lines.append(
            f"switch {name}: cos(grad J, -delta) {_figure(new, 'cos_update', '.3f')} on the new "
            f"task, {_figure(figures, 'cos_update', '.3f')} on the old one (first-order effect "
            f"of its updates {_figure(new, 'total_update', '.3g')} / "
            f"{_figure(figures, 'total_update', '.3g')})"
        )
    for metric, figures in result.get("transfer", {}).get("summary", {}).items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if v is not None)
        lines.append(f"transfer ({metric}): {shown}")
    for kind, figures in result.get("regret", {}).items():
        U = np.array(figures["utility"], dtype=float)
        off = U[~np.eye(len(U), dtype=bool)]
        lines.append(
            f"regret utility ({kind}): same task {np.mean(np.diag(U)):.3f}, other tasks "
            f"{np.mean(off) if off.size else float('nan'):.3f} (loss per sequence, summed)"
        )
    if "capacity" in result:
        gap = result["capacity"]["early_late"]
        lines.append(
            f"capacity: first-session loss early {gap['early']:.3f}, late {gap['late']:.3f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """The figures of a :func:`run` result, as PNGs in ``directory``: the ``R`` heatmap, the
    alignment by position per level, the regret curves with and without prior experience, the
    first-session loss over a long stream. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    paths = []

    def save(fig, name: str):
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    if "transfer" in result:
        R = result["transfer"]["R"]
        metric = "memory_accuracy" if "memory_accuracy" in R else "accuracy"
        matrix = np.array(R[metric], dtype=float)
        fig, ax = plt.subplots(figsize=(4.5, 4))
        image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis")
        for (i, j), value in np.ndenumerate(matrix):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set(xlabel="evaluated on task j", ylabel="after phase i", title=f"R: {metric}")
        fig.colorbar(image, ax=ax)
        save(fig, "plasticity_transfer.png")
    levels = result.get("alignment", {}).get("trained", {}).get("through_scan", {}).get("levels")
    if levels:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, figures in levels.items():
            by_position = figures["by_position"]
            ax.plot(by_position["position"], by_position["cos_local"], label=f"{name}: cos local")
            ax.plot(
                by_position["position"],
                by_position["cos_update"],
                "--",
                label=f"{name}: cos update",
            )
        ax.axhline(0, color="k", lw=0.5)
        ax.set(xlabel="position of the update", ylabel="cosine with grad J", title="alignment")
        ax.legend(fontsize=7)
        save(fig, "plasticity_alignment.png")
    switch = result.get("alignment", {}).get("switch")
    if switch:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in switch["old_task"]["levels"]:
            for task, style in (("old_task", "-"), ("new_task", "--")):
                by_position = switch[task]["levels"][name]["by_position"]
                label = f"{name}: J on the {task.replace('_', ' ')}"
                # a slow level updates at a few positions only: its points, marked
                points = [
                    (p, c)
                    for p, c in zip(by_position["position"], by_position["cos_update"], strict=True)
                    if c is not None
                ]
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker=".", label=label)
        ax.axhline(0, color="k", lw=0.5)
        ax.set(
            xlabel="position of the update in the new task's first batch",
            ylabel="cos(grad J, -delta)",
            title="alignment over a task switch",
        )
        ax.legend(fontsize=7)
        save(fig, "plasticity_switch.png")
    if "regret" in result:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for ax, kind in zip(axes, ("fast", "slow"), strict=True):
            curves = result["regret"][kind]["curves"]
            for b, fresh in curves["fresh"].items():
                line = ax.plot(fresh, label=f"B={b} fresh")[0]
                primed = [c for key, c in curves["primed"].items() if key.endswith(f"->{b}")]
                ax.plot(
                    np.mean(primed, axis=0), "--", color=line.get_color(), label=f"B={b} primed"
                )
            ax.set(
                xlabel="sequence of the session on B", title=f"cumulative loss ({kind} dtheta_A)"
            )
        axes[0].set_ylabel("cumulative online loss")
        axes[1].legend(fontsize=6)
        save(fig, "plasticity_regret.png")
    if "capacity" in result:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(result["capacity"]["first_session_loss"], marker="o")
        ax.set(xlabel="phase of the stream", ylabel="online loss of its first session")
        save(fig, "plasticity_capacity.png")
    return paths
