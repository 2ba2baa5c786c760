"""The pieces a run is built from, each usable alone: batch checks, the device layout, the
jitted train, eval and alignment functions, and the initial state.

Training batch ``i`` is ``task.batch(i, batch_size)``, a pure function of ``i``
(:func:`stacked_batches` stacks ``train.steps_per_call`` of them for one call); every batch is
checked (:func:`check_arrays`) before it reaches the device. One code path for 1 or N
devices: the state is created and kept with the shardings of :mod:`nested.run.sharding` on
the mesh ``train.mesh`` (:func:`make_layout`), and every jitted function takes and returns
those shardings.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from nested import data
from nested.core.scheduler import Program, State
from nested.plasticity import alignment
from nested.run import partitioning, sharding
from nested.run.config import ConfigError, Experiment


def check_arrays(
    arrays: Mapping[str, np.ndarray], vocab: int, where: str, *, grid: int = 1
) -> None:
    """Refuse a task's batch the model would misread silently (:func:`nested.data.check_arrays`:
    token ids outside ``[0, task.vocab_size)``, arrays of different shapes, documents off the
    task's ``grid``) with a :class:`ConfigError`; ``where`` names the batch."""
    try:
        data.check_arrays(arrays, vocab, where, source="task.vocab_size", fix=_VOCAB_FIX, grid=grid)
    except ValueError as error:
        raise ConfigError(str(error)) from error


_VOCAB_FIX = "raise task.vocab_size or fix the task's data"


def document_grid(task) -> int:
    """Where the task's documents start (``nested.data.TokensTask.document_grid``; 1: any)."""
    return getattr(task, "document_grid", 1)


def check_task(task) -> None:
    """Raise :class:`ConfigError` naming the task when it cannot make a batch of one of its
    splits (a char-LM corpus that is missing, empty or too small), before anything is
    compiled or written."""
    for split in ("train", *task.eval_splits):
        try:
            batch = data.as_arrays(task.batch(0, 1, split=split))
            check_arrays(
                batch, task.vocab_size, f"{task.name}: {split} batch 0", grid=document_grid(task)
            )
        except ValueError as error:
            raise ConfigError(f"task: {error}") from error


def _rows_of(task, index: int, batch_size: int, rows: slice) -> dict[str, np.ndarray]:
    """``rows`` of training batch ``index``; read alone where the task's ``batch`` takes
    ``rows`` (``nested.data.TokensTask``: a process reads only its rows)."""
    if "rows" in inspect.signature(task.batch).parameters:
        made = task.batch(index, batch_size, rows=rows)
        return data.as_arrays(made, extras=data.STREAM_EXTRAS)
    made = data.as_arrays(task.batch(index, batch_size), extras=data.STREAM_EXTRAS)
    return {k: v[rows] for k, v in made.items()}


def stacked_batches(
    task, start: int, count: int, batch_size: int, rows: slice = slice(None)
) -> dict[str, np.ndarray]:
    """Training batches ``start .. start + count - 1`` stacked on a leading axis (each
    checked with :func:`check_arrays`); of each only ``rows`` (a process's share)."""
    batches = [_rows_of(task, i, batch_size, rows) for i in range(start, start + count)]
    for i, arrays in enumerate(batches):
        where = f"task {task.name}: training batch {start + i}"
        check_arrays(arrays, task.vocab_size, where, grid=document_grid(task))
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def make_layout(exp: Experiment, *, devices=None) -> sharding.Layout:
    """The mesh of ``train.mesh`` over ``devices`` (default: all) and the shardings of the
    run's state under ``train.mesh.rules``; raises :class:`ConfigError` naming the key when
    the mesh does not fit the devices, a batch size or a parameter's dimension. Logs the
    parameters of 1 MiB or more that no rule shards."""
    cfg = exp.config.train
    devices = list(jax.devices() if devices is None else devices)
    try:
        mesh = cfg.get("mesh")
        settings = sharding.check_mesh({} if mesh is None else mesh.to_dict())
        sizes = sharding.mesh_sizes(settings, len(devices), platform=devices[0].platform)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    mesh = sharding.make_mesh(**sizes, devices=devices)
    rules = settings["rules"]
    microbatches = cfg.get("microbatches", 1)
    checks = [
        (cfg.batch_size, f"train.batch_size={cfg.batch_size}"),
        (cfg.eval_batch_size, f"train.eval_batch_size={cfg.eval_batch_size}"),
    ]
    if microbatches > 1:
        part = cfg.batch_size // microbatches
        whole = f"train.batch_size={cfg.batch_size} / train.microbatches={microbatches}"
        checks.append((part, f"{whole}: a microbatch of {part} rows"))
    for rows, subject in checks:
        try:
            sharding.check_batch(rows, mesh, rules, subject=subject)
        except ValueError as error:
            raise ConfigError(f"{error} ({sharding.describe(mesh)})") from error
    abstract = jax.eval_shape(init_fn(exp), jax.random.key(0))
    try:
        layout = sharding.Layout.of(abstract, mesh, rules)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    whole = partitioning.replicated_large(
        abstract.params, jax.tree.map(lambda s: s.spec, layout.state.params)
    )
    if whole and mesh.size > 1:
        logging.warning("parameters no rule of train.mesh.rules shards: %s", "; ".join(whole))
    return layout


def make_train_fn(program: Program, layout: sharding.Layout | None = None):
    """``(state, batches) -> (state, metrics)``: ``len(batches)`` outer steps in one call.

    With ``layout``: the state keeps its shardings, the batches (stacked on a leading axis)
    are split along the mesh's data axis, the metrics come back replicated. The state is not
    donated: an asynchronous checkpoint may still be reading the previous one.
    """
    run = lambda state, batches: jax.lax.scan(program.train_step, state, batches)
    if layout is None:
        return jax.jit(run)
    return jax.jit(
        run,
        in_shardings=(layout.state, layout.batch(stacked=True)),
        out_shardings=(layout.state, layout.replicated),
    )


def make_eval_fn(program: Program, layout: sharding.Layout | None = None):
    """``(state, batch) -> (metrics, fast)``: the outer objective on a held-out batch, and the
    fast state the batch leaves (None unless a level carries its state across sequences).
    Extra masks in ``batch`` (``in_context``) add ``in_context_accuracy`` and
    ``memory_accuracy`` (queries answerable only from memory). ``layout``: as in
    :func:`make_train_fn`."""

    def run(state: State, batch):
        main = {k: batch[k] for k in ("inputs", "targets", "mask")}
        fast = program.stream_start(state.params, batch, state.fast)
        _, (out, new_fast) = program.loss(state.params, main, fast)
        out = {"loss": out["loss"], "accuracy": out["accuracy"]}
        if "in_context" in batch:
            for name, mask in (
                ("in_context", batch["in_context"]),
                ("memory", main["mask"] - batch["in_context"]),
            ):
                _, (sub, _) = program.loss(state.params, {**main, "mask": mask}, fast)
                out[f"{name}_accuracy"] = sub["accuracy"]
                out[f"{name}_count"] = jnp.sum(mask)
        out["count"] = jnp.sum(main["mask"])
        return out, (None if state.fast is None else new_fast)

    if layout is None:
        return jax.jit(run)
    return jax.jit(
        run,
        in_shardings=(layout.state, layout.batch()),
        out_shardings=(layout.replicated, layout.state.fast),
    )


def _alignment_measure(program: Program, form: str, rows: int):
    """``(state, batch) -> one UpdateAlignment per probed call``, jitted: the alignment of the
    first ``rows`` rows of ``batch`` (:func:`nested.plasticity.alignment.measure_program`)."""

    @jax.jit
    def measure(state: State, batch):
        fast = program.stream_start(state.params, batch, state.fast)
        fast = jax.tree.map(lambda x: x[:rows], fast)
        batch = jax.tree.map(lambda x: x[:rows], batch)
        return alignment.measure_program(program, state.params, batch, fast=fast, form=form)[1]

    return measure


def make_alignment_fn(program: Program, form: str, rows: int):
    """``(state, batch) -> {"<level>/<figure>": value}``: the alignment of every update of the
    probed fast levels with the outer loss of the first ``rows`` rows of ``batch``
    (:mod:`nested.plasticity.alignment`, ``form``), summarised per level, for the training log
    (``plasticity.every``)."""
    measure = _alignment_measure(program, form, rows)

    def figures(state: State, batch) -> dict[str, float]:
        summary = alignment.summarize(measure(state, batch))
        return {
            f"{level}/{name}": values[name]
            for level, values in summary.items()
            for name in alignment.SCALARS
        }

    return figures


def check_alignment(program: Program, state: State, batches, form: str, rows: int) -> None:
    """Raise :class:`ConfigError` before training when ``plasticity.every`` asks for figures
    the model cannot give (no probe-able fast level: outer-loss blocks, scanned levels): the
    measurement of one of the stacked ``batches`` is traced, not run."""
    batch = {k: v[0] for k, v in batches.items()}
    try:
        jax.eval_shape(_alignment_measure(program, form, rows), state, batch)
    except ValueError as error:
        raise ConfigError(f"plasticity.every: {' '.join(str(error).split())}") from error


def init_fn(exp: Experiment):
    """``key -> State``: the program's init, with fast states for ``train.batch_size`` rows
    where a level carries its state across sequences."""
    batch_size = exp.config.train.batch_size if exp.carries_fast else None
    return functools.partial(exp.program.init, batch_size=batch_size)


def init_state(exp: Experiment, layout: sharding.Layout | None = None) -> State:
    """A fresh state: the model from ``config.seed``; carried fast states when needed;
    created directly with the shardings of ``layout`` when given."""
    # One compiled init instead of one eager dispatch (and compile) per initialiser.
    if layout is None:
        init = jax.jit(init_fn(exp))
    else:
        init = jax.jit(init_fn(exp), out_shardings=layout.state)
    return init(jax.random.key(exp.config.seed))
