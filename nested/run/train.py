"""The training loop, ``train_and_evaluate(config, workdir)``, and workdir evaluation.

One linear loop over outer steps, read top to bottom:

1. **Build**: check the workdir (:func:`check_workdir`: one that cannot be created or written
   to raises first), validate the config and build the task, nested system and program
   (:func:`nested.run.config.build`; a bad config raises before anything is compiled), check
   that the task makes batches (:func:`check_task`: a missing corpus), and the device mesh of
   ``train.mesh`` (:func:`make_layout`). Nothing is written before all of it passes.
2. **State**: initialise it on the mesh, or resume from the latest readable checkpoint of
   ``<workdir>/checkpoints`` (state, data position and unfinished log window; see
   :mod:`nested.run.checkpoint`), whatever mesh it was saved from. Only a run that starts
   (a checkpoint of this model, at most ``train.steps``) records its config, ``config.json``.
3. **Loop**: each call of one jitted function runs ``train.steps_per_call`` outer steps, a
   ``lax.scan`` of ``Program.train_step`` over stacked batches. Between calls, on the host:
   the non-finite check (skipped steps counted, the run stopped past
   ``train.max_skipped_fraction``), a log record every ``log_every`` steps (means over the
   window), an evaluation of every held-out split every ``eval_every`` steps, with
   ``plasticity.every`` the alignment of the fast levels' updates on the latest batch
   (:func:`make_alignment_fn`), a checkpoint every ``checkpoint_every`` steps. SIGTERM (a
   preemption) ends the loop after the current call with a checkpoint of the step reached,
   and raises :class:`Stopped`.
4. **End**: a final evaluation and checkpoint, ``curves.png``, the printed summary.

Training batch ``i`` is ``task.batch(i, batch_size)``, a pure function of ``i``, so the data
position is the next ``i`` and a resumed run sees the batches an uninterrupted one would:
on CPU it reproduces the uninterrupted run's metrics exactly, however often it was killed.

**Devices.** One code path for 1 or N devices: the state is created and kept with the
shardings of :mod:`nested.run.sharding` on the mesh ``train.mesh`` (axes ``data``, ``fsdp``,
``tensor``: batches and carried fast states split along ``data`` and ``fsdp``, memory heads
along ``tensor`` where they divide, slow parameters and their optimizer state as
``train.mesh.rules`` place their logical axes, :mod:`nested.run.partitioning`), every
jitted function takes and returns those shardings, and XLA inserts the collectives. On N
devices the losses equal one device's up to float summation order (``tests/test_sharding.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from ml_collections import config_dict
from tqdm import tqdm

from nested import data, files
from nested.core import guards
from nested.core.scheduler import Program, State
from nested.plasticity import alignment
from nested.run import (
    checkpoint,
    distributed,
    fingerprint,
    locks,
    memory_state,
    metrics,
    partitioning,
    sharding,
)
from nested.run import config as config_lib
from nested.run.config import ConfigError, Experiment

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
EVAL_FILE = "eval.json"  # the evaluation of the latest checkpoint
SESSIONS_FILE = "sessions.jsonl"  # one line per memory session, appended
LOCK_FILE = "run.lock"  # held by the training run writing the workdir (nested.run.locks)


class Stopped(Exception):
    """The run was asked to stop (SIGTERM or SIGINT, ``signum``) and saved a checkpoint of the
    step it reached."""

    def __init__(self, step: int, directory: Path, signum: int = signal.SIGTERM):
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}: its checkpoint is in "
            f"{directory}; run the same command to resume from step {step}"
        )
        self.step, self.signum = step, signum


# -- pieces (each usable alone) ---------------------------------------------------------------


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


def _grid(task) -> int:
    """Where the task's documents start (``nested.data.TokensTask.document_grid``; 1: any)."""
    return getattr(task, "document_grid", 1)


def check_task(task) -> None:
    """Raise :class:`ConfigError` naming the task when it cannot make a batch of one of its
    splits (a char-LM corpus that is missing, empty or too small), before anything is
    compiled or written."""
    for split in ("train", *task.eval_splits):
        try:
            batch = data.as_arrays(task.batch(0, 1, split=split))
            check_arrays(batch, task.vocab_size, f"{task.name}: {split} batch 0", grid=_grid(task))
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
        check_arrays(arrays, task.vocab_size, where, grid=_grid(task))
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
    abstract = jax.eval_shape(_init_fn(exp), jax.random.key(0))
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


def evaluate(
    eval_fn,
    state: State,
    task,
    *,
    batches: int,
    batch_size: int,
    splits: Iterable[str] | None = None,
    carry: bool = False,
    layout: sharding.Layout | None = None,
    progress: bool = False,
) -> tuple[dict[str, dict[str, float]], object]:
    """Metrics per held-out split, averaged over ``batches`` batches weighted by the number
    of scored positions; and the final fast state.

    ``carry=False``: every batch starts from ``state.fast`` (evaluation does not write into
    the run). ``carry=True`` (a session): the fast state carries from batch to batch, split
    after split, and the one it ends with is returned, so the model keeps learning.
    ``layout``: the batches become global arrays of it, this process feeding its rows.
    ``progress``: a progress bar over the batches (on a terminal).
    """
    rows = slice(None) if layout is None else layout.rows(batch_size)
    fast = state.fast
    results = {}
    splits = list(task.eval_splits if splits is None else splits)
    bar = tqdm(
        total=len(splits) * batches,
        unit="batch",
        desc="eval",
        file=sys.stderr,
        disable=None if progress else True,
    )
    for split in splits:
        parts = []
        for i in range(batches):
            made = task.batch(i, batch_size, split=split)
            batch = data.as_arrays(made, extras=(*data.STREAM_EXTRAS, "in_context"))
            batch = {k: v[rows] for k, v in batch.items()}
            where = f"task {task.name}: {split} batch {i}"
            check_arrays(batch, task.vocab_size, where, grid=_grid(task))
            if layout is not None:
                batch = layout.put(batch, batch_size)
            out, new_fast = eval_fn(state.replace(fast=fast) if carry else state, batch)
            parts.append(jax.device_get(out))
            bar.update()
            if carry:
                fast = new_fast
        results[split] = _aggregate(parts, task)
    bar.close()
    return results, fast


def _aggregate(parts: list[Mapping[str, float]], task) -> dict[str, float]:
    out = metrics.mean(
        [{"loss": p["loss"], "accuracy": p["accuracy"]} for p in parts], [p["count"] for p in parts]
    )
    for name in ("in_context", "memory"):
        weights = [float(p.get(f"{name}_count", 0.0)) for p in parts]
        if sum(weights) > 0:
            values = [{"a": p[f"{name}_accuracy"]} for p in parts]
            out[f"{name}_accuracy"] = metrics.mean(values, weights)["a"]
    if task.name == "char_lm":
        out["bpc"] = float(data.bits_per_char(out["loss"]))
    return out


def _init_fn(exp: Experiment):
    batch_size = exp.config.train.batch_size if exp.carries_fast else None
    return functools.partial(exp.program.init, batch_size=batch_size)


def init_state(exp: Experiment, layout: sharding.Layout | None = None) -> State:
    """A fresh state: the model from ``config.seed``; carried fast states when needed;
    created directly with the shardings of ``layout`` when given."""
    # One compiled init instead of one eager dispatch (and compile) per initialiser.
    if layout is None:
        init = jax.jit(_init_fn(exp))
    else:
        init = jax.jit(_init_fn(exp), out_shardings=layout.state)
    return init(jax.random.key(exp.config.seed))


def _flat(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple | list) else value
    return out


def _record_config(config: config_dict.ConfigDict, workdir: Path, step: int) -> None:
    """Write ``config.json`` as the run starts at ``step`` (0, or the checkpoint it resumes
    from). When the saved one has other values, warn naming the keys and keep it as
    ``config.<step>.json``, the config of the steps up to ``step``."""
    path = workdir / CONFIG_FILE
    current = json.loads(config.to_json_best_effort())
    if path.exists():
        saved = path.read_text(errors="replace")
        try:
            before = _flat(json.loads(saved))
        except json.JSONDecodeError as error:
            logging.warning("%s is unreadable (%s); replacing it", path, error)
            before = _flat(current)
        now = _flat(current)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if changed:
            kept = workdir / f"config.{step}.json"
            files.write_atomic(kept, saved)
            logging.warning(
                "config differs from the one saved in %s: %s; that one is kept as %s",
                path,
                changed,
                kept,
            )
    files.write_atomic(path, json.dumps(current, indent=2) + "\n")


def check_workdir(workdir: Path) -> None:
    """Raise :class:`ConfigError` naming ``workdir`` and the fix when it is a file or cannot be
    created or written to. It is created to find out, then removed again if it was new (with
    the parents made for it): a run that fails to build leaves nothing behind. (Not in a
    multi-process run: the processes check it side by side, and it stays.)"""
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir {workdir} is a file; pass a folder (new or of this run)")
    new = [path for path in (workdir, *workdir.parents) if not path.exists()]  # deepest first
    if jax.process_count() > 1:
        new = []
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as error:
        raise ConfigError(
            f"workdir {workdir} cannot be created or written to ({error.strerror}); pass a "
            "folder you can write to (new or of this run)"
        ) from error
    finally:
        for path in new:
            with contextlib.suppress(OSError):
                path.rmdir()


def check_run(workdir: str | Path) -> Path:
    """The checkpoint folder of the run in ``workdir``; raises :class:`ConfigError` when there
    is no run there (no checkpoint folder)."""
    directory = Path(workdir) / CHECKPOINTS
    if not directory.is_dir():
        raise ConfigError(
            f"no run in --workdir {workdir} (no {CHECKPOINTS} folder): train one there first "
            f"(experiments/train.py --workdir {workdir})"
        )
    return directory


def _check_same_config(config: config_dict.ConfigDict, workdir: Path) -> None:
    """Every process of a multi-process run must run the same loop on the same model."""
    distributed.check_same(
        f"{config.to_json_best_effort(sort_keys=True)}\n{workdir.absolute()}",
        "config or --workdir",
        "start every process with the same command line (only the process flags differ)",
    )


def restore_latest(
    exp: Experiment, directory: Path, layout: sharding.Layout | None = None, step=None
) -> checkpoint.Restored:
    """The latest readable checkpoint of ``directory`` (``step``: that one) restored into the
    state of ``exp`` (on ``layout``'s shardings when given); raises
    :class:`nested.run.checkpoint.CheckpointError` when none is readable (damaged ones are
    set aside, as the checkpointer does)."""
    cfg = exp.config.train
    every, keep = cfg.checkpoint_every, cfg.keep_checkpoints
    with checkpoint.Checkpointer(directory, every=every, keep=keep) as ckpt:
        restored = ckpt.restore_latest(init_state(exp, layout), step)
    if restored is None:
        which = "readable checkpoint" if step is None else f"readable checkpoint of step {step}"
        raise checkpoint.CheckpointError(f"no {which} in {directory}")
    return restored


def load_workdir_config(workdir: str | Path) -> config_dict.ConfigDict:
    """The config a run in ``workdir`` was trained with (typed as its config file made it:
    :func:`nested.run.config_schema.from_json`)."""
    check_run(workdir)
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(
            f"--workdir {workdir} has no {CONFIG_FILE}; pass --config, the file it was trained with"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a readable config ({error}); pass --config") from error
    return config_lib.from_json(data)


class StopRequest:
    """Set by the first SIGTERM or SIGINT (Ctrl-C): the loop then saves a checkpoint of the
    step it reaches and stops. ``signum`` is the signal that asked."""

    def __init__(self):
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self.signum is not None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_requests() -> Iterator[StopRequest]:
    """A :class:`StopRequest` that SIGTERM or SIGINT sets; a second one of either ends the
    process at once (the first says so on stderr). Outside the main thread no handler can be
    installed: nothing is, and the request stays unset."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        request.signum = signum
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        # os.write, not print: the main thread may be inside a buffered write.
        name = signal.Signals(signum).name
        os.write(
            2,
            f"\n{name}: saving a checkpoint at the end of this step, then stopping; "
            f"{name} again stops at once (steps since the last checkpoint are lost)\n".encode(),
        )

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


# -- the loop ---------------------------------------------------------------------------------


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str | Path) -> dict:
    """Train the system of ``config`` in ``workdir`` (resuming if it holds checkpoints),
    evaluate it, plot the curves and return the summary (see :func:`nested.run.metrics.summary`).

    Raises :class:`Stopped` after saving a checkpoint when the process receives SIGTERM or
    SIGINT, and :class:`nested.run.locks.Busy` when another run holds the workdir.
    """
    # 1. Build: the workdir and everything else are checked before anything is compiled.
    workdir = Path(workdir)
    check_workdir(workdir)
    exp = config_lib.build(config)
    _check_same_config(exp.config, workdir)
    cfg, task, program = exp.config.train, exp.task, exp.program
    plasticity = exp.plasticity
    if plasticity["every"] and jax.process_count() > 1:
        raise ConfigError(
            "plasticity.every runs in single-process runs only; set plasticity.every=0 and "
            "measure a checkpoint with experiments/plasticity.py"
        )
    check_task(task)
    layout = make_layout(exp)
    primary = distributed.is_primary()
    workdir.mkdir(parents=True, exist_ok=True)
    logging.info("task: %s", task.describe())
    logging.info("system: %s", exp.system)
    logging.info("mesh: %s", sharding.describe(layout.mesh))

    # 2. State: fresh, or the latest readable checkpoint.
    state = init_state(exp, layout)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("model: %d slow parameters", n_params)
    writer = bar = lock = ckpt = None
    # SIGTERM or Ctrl-C stops the loop after its current call, once the last save is on disk.
    with _stop_requests() as stop:
        try:
            if primary:  # one run per workdir (the processes of one run share it)
                lock = locks.Lock(
                    workdir / LOCK_FILE,
                    f"workdir {workdir}",
                    "wait for that run to end, stop it, or train in another --workdir",
                )
            ckpt = checkpoint.Checkpointer(
                workdir / CHECKPOINTS, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints
            )
            restored = ckpt.restore_latest(state)
            step, position, window = 0, 0, []
            if restored is not None:
                state, step, position = restored.state, restored.step, restored.data_position
                window = list(restored.extra.get("window", []))
                logging.info("resumed from the checkpoint of step %d in %s", step, ckpt.directory)
                if step > cfg.steps:
                    raise ConfigError(
                        f"train.steps={cfg.steps} is below the step {step} of the checkpoint in "
                        f"{ckpt.directory}; set train.steps >= {step} or use a new workdir"
                    )
            # Counted before the writer drops the records past the checkpoint, from the
            # ones up to it: every process counts the same.
            records = metrics.read(workdir) if restored else []
            skipped = metrics.skipped(r for r in records if r["step"] <= step) or 0
            skipped += sum(int(v.get("skipped", 0)) for v in window)
            if primary:  # the run starts
                _record_config(exp.config, workdir, step)
            resume = step if restored else None
            writer = metrics.MetricWriter(workdir, resume_step=resume, write=primary)

            # 3. Loop: one jitted call per `steps_per_call` outer steps.
            train_fn, eval_fn = make_train_fn(program, layout), make_eval_fn(program, layout)
            window_start, tokens = time.perf_counter(), 0
            show = None if primary else True  # tqdm: None shows it on a terminal
            bar = tqdm(total=cfg.steps, initial=step, unit="step", disable=show, file=sys.stderr)
            rows = layout.rows(cfg.batch_size)  # this process's share of every batch
            first = min(cfg.steps_per_call, cfg.steps - step)
            batches = None
            if first > 0:
                batches = stacked_batches(task, position, first, cfg.batch_size, rows)
            if plasticity["every"] and batches is not None:
                form, measured = plasticity["form"], plasticity["rows"]
                check_alignment(program, state, batches, form, measured)
                alignment_fn = make_alignment_fn(program, form, measured)
            start_time = time.perf_counter()
            while step < cfg.steps:  # one iteration per jitted call
                count, length = batches["inputs"].shape[0], batches["inputs"].shape[-1]
                n_tokens = count * cfg.batch_size * length
                latest = {k: v[-1] for k, v in batches.items()}
                state, out = train_fn(state, layout.put(batches, cfg.batch_size, stacked=True))
                position += count
                following = min(cfg.steps_per_call, cfg.steps - step - count)
                if following > 0:  # build the next batches while the device works
                    batches = stacked_batches(task, position, following, cfg.batch_size, rows)
                out = jax.device_get(out)
                for i in range(count):
                    values = {k: float(v[i]) for k, v in out.items()}
                    window.append(_checked(values, step + i + 1))
                    skipped += int(values.get("skipped", 0))
                step, tokens = step + count, tokens + n_tokens
                _check_skipped(skipped, step, cfg)
                rate = tokens / max(time.perf_counter() - window_start, 1e-9)
                bar.update(count)
                # The bar shows what the log lines show: the mean over the log window so far.
                window_loss = _window_means(window).get("loss", float("nan"))
                bar.set_postfix(loss=f"{window_loss:.4f}", tokens_per_s=f"{rate:.0f}")

                if step % cfg.log_every == 0 or step == cfg.steps:
                    seconds = time.perf_counter() - window_start
                    values = _window_means(window)
                    values["learning_rate"] = float(exp.schedule(step - 1))
                    values["tokens_per_s"] = tokens / seconds
                    record = writer.write(step, metrics.TRAIN, values)
                    shown = ("loss", "accuracy", "grad_norm", "tokens_per_s")
                    with tqdm.external_write_mode(file=sys.stderr):  # the line above the bar
                        logging.info("step %d/%d: %s", step, cfg.steps, _fmt(record, shown))
                    window, window_start, tokens = [], time.perf_counter(), 0
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    _evaluate_and_log(eval_fn, state, task, cfg, writer, step, layout)
                if plasticity["every"] and step % plasticity["every"] == 0:
                    writer.write(step, metrics.PLASTICITY, alignment_fn(state, latest))
                # The unfinished log window goes with the state, so a run resumed from any
                # step logs the windows an uninterrupted one does.
                saved = {"data_position": position, "extra": {"window": window}}
                # Read the flag once: a SIGTERM landing between the save and the check must
                # not stop the run with a checkpoint that was never forced. Every process
                # stops at the same step when any was signalled.
                stopping = distributed.any_process(stop.is_set()) and step < cfg.steps
                ckpt.save(step, state, force=step == cfg.steps or stopping, **saved)
                if stopping:
                    ckpt.wait()
                    signum = stop.signum or signal.SIGTERM  # another process was signalled
                    name = signal.Signals(signum).name
                    logging.warning("%s: saved the checkpoint of step %d; stopping", name, step)
                    raise Stopped(step, ckpt.directory, signum)
            if restored is not None and restored.step == cfg.steps:
                logging.info("the run in %s is complete (step %d)", workdir, step)
            train_seconds = time.perf_counter() - start_time
        except jax.errors.JaxRuntimeError as error:  # a peer died inside a collective
            distributed.collective_failed(error)
            raise
        finally:
            if bar is not None:
                bar.close()
            if ckpt is not None:
                ckpt.close()
            if writer is not None:
                writer.close()
            if lock is not None:
                lock.release()

    # 4. End: plot and summary (process 0 writes; every process returns the summary).
    distributed.barrier("nested: metrics written")
    records = metrics.read(workdir)
    result = metrics.summary(records)
    result.update(train_seconds=train_seconds)
    if primary:
        plot = metrics.plot(records, workdir / metrics.PLOT_FILE, title=_title(exp.config))
        result.update(plot=str(plot))
        print(metrics.format_summary(result))
        print(f"curves: {plot}")
    distributed.finish()
    return result


_OUTER = ("loss", "grads")  # the outer level's health flags; the others name fast levels


def _checked(values: dict[str, float], step: int) -> dict[str, float]:
    """One step's metrics, after the health flags of :mod:`nested.core.guards` are checked: a
    non-finite step stops the run, unless the program skips such steps (``skipped = 1``)."""
    message = guards.failure(values, step)
    if message is not None and not values.get("skipped"):
        levels = [
            f"levels.{k[len(guards.PREFIX) :]}"
            for k, ok in values.items()
            if k.startswith(guards.PREFIX) and not ok and k[len(guards.PREFIX) :] not in _OUTER
        ]
        rates = " or the learning rates of " + ", ".join(levels) if levels else ""
        raise guards.NonFiniteError(
            f"{message}; the run stopped (lower optimizer.learning_rate{rates}, set "
            f"optimizer.grad_clip, or skip such steps with train.skip_nonfinite=True)"
        )
    return {k: v for k, v in values.items() if not k.startswith(metrics.CHECKS_PREFIX)}


def _check_skipped(skipped: int, step: int, cfg) -> None:
    """Stop the run once more than ``train.max_skipped_fraction`` of its steps were skipped
    as non-finite: the model it would end with is not trained."""
    limit = cfg.max_skipped_fraction
    if skipped > limit * cfg.steps:
        raise guards.NonFiniteError(
            f"step {step}: {skipped} of the run's train.steps={cfg.steps} steps were skipped as "
            f"non-finite, more than train.max_skipped_fraction={limit} of them; the run stopped "
            "(lower optimizer.learning_rate, set optimizer.grad_clip, or raise "
            "train.max_skipped_fraction)"
        )


def _window_means(window: list[dict[str, float]]) -> dict[str, float]:
    """Means over the steps of a log window (skipped steps excluded; their count kept)."""
    kept = [v for v in window if not v.get("skipped")]
    values = metrics.mean(kept) if kept else {}
    if "skipped" in window[0]:
        values["skipped"] = float(sum(v["skipped"] for v in window))
    return values


def _evaluate_and_log(eval_fn, state, task, cfg, writer, step, layout) -> None:
    results, _ = evaluate(
        eval_fn,
        state,
        task,
        batches=cfg.eval_batches,
        batch_size=cfg.eval_batch_size,
        layout=layout,
    )
    for split, values in results.items():
        record = writer.write(step, split, values)
        shown = ("loss", "accuracy", "bpc")
        with tqdm.external_write_mode(file=sys.stderr):
            logging.info("eval %s at step %d: %s", split, step, _fmt(record, shown))


def _fmt(record: Mapping, names: Iterable[str]) -> str:
    return " ".join(f"{n}={record[n]:.4g}" for n in names if n in record)


def _title(config) -> str:
    rules = ", ".join(f"{n}={s.rule}(every={s.every})" for n, s in config.levels.items())
    return f"{config.task.name}: {config.model.name}, {rules}"


# -- evaluating a workdir ---------------------------------------------------------------------


def _check_memory_is_read(task, batch_size: int, load_memory) -> None:
    """Raise :class:`ConfigError` when the first eval batch of a split restarts every row
    (its ``reset`` extra: a new agent in each row), which would replace the loaded memory by
    the learned initial state before it is read."""
    for split in task.eval_splits:
        batch = data.as_arrays(task.batch(0, batch_size, split=split), extras=data.STREAM_EXTRAS)
        reset = batch.get("reset")
        if reset is not None and bool(np.all(reset[:, 0] > 0)):
            raise ConfigError(
                f"--load_memory={load_memory}: task {task.name} starts a new agent in every row "
                f"at its first {split} batch, so the loaded memory would be replaced by the "
                f"learned initial state before it is read; evaluate it on a task without agents "
                f"(e.g. --config.task.agent_every=0)"
            )


def evaluate_workdir(
    config: config_dict.ConfigDict | None,
    workdir: str | Path,
    *,
    load_memory: str | Path | None = None,
    save_memory: str | Path | None = None,
) -> dict:
    """Evaluate the latest checkpoint of ``workdir`` on every held-out split.

    ``config``: the run's config (None: the one saved in the workdir). Without a session the
    summary is written to ``eval.json``. With ``load_memory`` or ``save_memory`` the
    evaluation is a *session*: the carried fast state starts from the memory state saved at
    ``load_memory`` (else the checkpoint's), carries through every eval batch, and is saved at
    ``save_memory`` when the session ends (:mod:`nested.run.memory_state`, with the model's
    fingerprint: a memory state of another model is refused); its summary, with both paths,
    is appended to ``sessions.jsonl``, so sessions never overwrite each other's results.
    Everything is checked (the run, the config, the task, the memory state to load) before
    anything is compiled. Returns the summary.
    """
    workdir = Path(workdir)
    directory = check_run(workdir)
    exp = config_lib.build(config if config is not None else load_workdir_config(workdir))
    _check_same_config(exp.config, workdir)
    cfg = exp.config.train
    session = load_memory is not None or save_memory is not None
    if session and not exp.carries_fast:
        names = list(exp.config.levels.keys())
        raise ConfigError(
            f"a memory session needs a level with persist='stream'; levels {names} restart at "
            f"every sequence (set --config.levels.<name>.persist=stream and retrain)"
        )
    if session and jax.process_count() > 1:
        raise ConfigError(
            "--load_memory/--save_memory: a memory session runs in one process; run eval.py "
            "without the multi-process flags"
        )
    if load_memory is not None:
        memory_state.read_meta(load_memory)
    check_task(exp.task)
    if load_memory is not None:
        _check_memory_is_read(exp.task, cfg.eval_batch_size, load_memory)
    layout = make_layout(exp)
    restored = restore_latest(exp, directory, layout)
    state, model = restored.state, fingerprint.of(exp.config, restored.step)
    if load_memory is not None:
        fast = memory_state.load(load_memory, like=state.fast, fingerprint=model)
        state = state.replace(fast=fast)
    results, fast = evaluate(
        make_eval_fn(exp.program, layout),
        state,
        exp.task,
        batches=cfg.eval_batches,
        batch_size=cfg.eval_batch_size,
        carry=session,
        layout=layout,
        progress=distributed.is_primary(),
    )
    if save_memory is not None:
        memory_state.save(save_memory, fast, fingerprint=model)
    records = [{"step": restored.step, "split": s, **v} for s, v in results.items()]
    result = metrics.summary(records)
    if session:
        paths = {"load_memory": load_memory, "save_memory": save_memory}
        result.update({k: None if v is None else str(v) for k, v in paths.items()})
        path = workdir / SESSIONS_FILE
        with path.open("a") as f:
            f.write(json.dumps(result) + "\n")
    else:
        path = workdir / EVAL_FILE
        if distributed.is_primary():
            files.write_atomic(path, json.dumps(result, indent=2) + "\n")
    if distributed.is_primary():
        print(metrics.format_summary(result))
        print(f"results: {path}")
    distributed.finish()
    return result
