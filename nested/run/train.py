"""The training loop, ``train_and_evaluate(config, workdir)``.

One linear loop over outer steps, read top to bottom:

1. **Build**: check the workdir (:func:`nested.run.rundir.check_workdir`), validate the config
   and build the task, nested system and program (:func:`nested.run.config.build`; a bad
   config raises before anything is compiled), check that the task makes batches
   (:func:`nested.run.steps.check_task`) and the device mesh of ``train.mesh``
   (:func:`nested.run.steps.make_layout`). Nothing is written before all of it passes.
2. **State**: initialise it on the mesh, or resume from the latest readable checkpoint of
   ``<workdir>/checkpoints`` (state, data position and unfinished log window; see
   :mod:`nested.run.checkpoint`), whatever mesh it was saved from. Only a run that starts
   (a checkpoint of this model, at most ``train.steps``) records its config, ``config.json``.
3. **Loop**: each call of one jitted function runs ``train.steps_per_call`` outer steps, a
   ``lax.scan`` of ``Program.train_step`` over stacked batches. Between calls, on the host:
   the non-finite check (skipped steps counted, the run stopped past
   ``train.max_skipped_fraction``), then the periodic actions (:class:`Periodic`): a log
   record every ``log_every`` steps (means over the window), an evaluation of every held-out
   split every ``eval_every`` steps, with ``plasticity.every`` the alignment of the fast
   levels' updates on the latest batch, and the checkpoint (every ``checkpoint_every``
   steps). SIGTERM (a preemption) ends the loop after the current call with a checkpoint of
   the step reached, and raises :class:`nested.run.stopping.Stopped`.
4. **End**: a final evaluation and checkpoint, ``curves.png``, the printed summary.

Training batch ``i`` is ``task.batch(i, batch_size)``, a pure function of ``i``, so the data
position is the next ``i`` and a resumed run sees the batches an uninterrupted one would:
on CPU it reproduces the uninterrupted run's metrics exactly, however often it was killed.
On N devices the losses equal one device's up to float summation order
(``tests/run/test_sharding.py``).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
from absl import logging
from ml_collections import config_dict
from tqdm import tqdm

from nested.core import guards
from nested.run import checkpoint, distributed, evaluation, locks, metrics, pieces, rundir, sharding
from nested.run import config as config_lib
from nested.run.config import ConfigError
from nested.run.stopping import Stopped, stop_requests


@dataclasses.dataclass(frozen=True)
class Periodic:
    """Work the loop does after the calls that reach a multiple of ``every`` steps (0: never)
    and, with ``at_end``, after the run's last step: ``action(step, state, batch)``, the batch
    the latest step trained on."""

    name: str
    every: int
    action: Callable
    at_end: bool = True

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and step % self.every == 0 or (self.at_end and step == last)


class LogWindow:
    """The steps since the last log record: their metrics, tokens and start time."""

    def __init__(self, steps: list[dict[str, float]]):
        self.steps, self.tokens, self.start = steps, 0, time.perf_counter()

    def means(self) -> dict[str, float]:
        """Means over the window's steps (skipped steps excluded; their count kept)."""
        kept = [v for v in self.steps if not v.get("skipped")]
        values = metrics.mean(kept) if kept else {}
        if self.steps and "skipped" in self.steps[0]:
            values["skipped"] = float(sum(v["skipped"] for v in self.steps))
        return values

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str | Path) -> dict:
    """Train the system of ``config`` in ``workdir`` (resuming if it holds checkpoints),
    evaluate it, plot the curves and return the summary (see :func:`nested.run.metrics.summary`).

    Raises :class:`Stopped` after saving a checkpoint when the process receives SIGTERM or
    SIGINT, and :class:`nested.run.locks.Busy` when another run holds the workdir.
    """
    # 1. Build: the workdir and everything else are checked before anything is compiled.
    workdir = Path(workdir)
    rundir.check_workdir(workdir)
    exp = config_lib.build(config)
    rundir.check_same_config(exp.config, workdir)
    cfg, task, program, plasticity = exp.config.train, exp.task, exp.program, exp.plasticity
    if plasticity["every"] and jax.process_count() > 1:
        raise ConfigError(
            "plasticity.every runs in single-process runs only; set plasticity.every=0 and "
            "measure a checkpoint with experiments/plasticity.py"
        )
    pieces.check_task(task)
    layout = pieces.make_layout(exp)
    primary = distributed.is_primary()
    workdir.mkdir(parents=True, exist_ok=True)
    logging.info("task: %s", task.describe())
    logging.info("system: %s", exp.system)
    logging.info("mesh: %s", sharding.describe(layout.mesh))

    # 2. State: fresh, or the latest readable checkpoint.
    state = pieces.init_state(exp, layout)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("model: %d slow parameters", n_params)
    writer = bar = lock = ckpt = None
    # SIGTERM or Ctrl-C stops the loop after its current call, once the last save is on disk.
    with stop_requests() as stop:
        try:
            if primary:  # one run per workdir (the processes of one run share it)
                lock = locks.Lock(
                    workdir / rundir.LOCK_FILE,
                    f"workdir {workdir}",
                    "wait for that run to end, stop it, or train in another --workdir",
                )
            ckpt = checkpoint.Checkpointer(
                workdir / rundir.CHECKPOINTS, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints
            )
            restored = ckpt.restore_latest(state)
            step, position, window = 0, 0, LogWindow([])
            if restored is not None:
                state, step, position = restored.state, restored.step, restored.data_position
                window = LogWindow(list(restored.extra.get("window", [])))
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
            skipped += sum(int(v.get("skipped", 0)) for v in window.steps)
            if primary:  # the run starts
                rundir.record_config(exp.config, workdir, step)
            resume = step if restored else None
            writer = metrics.MetricWriter(workdir, resume_step=resume, write=primary)

            # 3. Loop: one jitted call per `steps_per_call` outer steps.
            train_fn = pieces.make_train_fn(program, layout)
            eval_fn = pieces.make_eval_fn(program, layout)
            show = None if primary else True  # tqdm: None shows it on a terminal
            bar = tqdm(total=cfg.steps, initial=step, unit="step", disable=show, file=sys.stderr)
            rows = layout.rows(cfg.batch_size)  # this process's share of every batch
            batches = None
            if step < cfg.steps:
                count = min(cfg.steps_per_call, cfg.steps - step)
                batches = pieces.stacked_batches(task, position, count, cfg.batch_size, rows)

            def log(step, state, batch):
                nonlocal window
                values = window.means()
                values["learning_rate"] = float(exp.schedule(step - 1))
                values["tokens_per_s"] = window.rate()
                record = writer.write(step, metrics.TRAIN, values)
                shown = ("loss", "accuracy", "grad_norm", "tokens_per_s")
                with tqdm.external_write_mode(file=sys.stderr):  # the line above the bar
                    logging.info("step %d/%d: %s", step, cfg.steps, _fmt(record, shown))
                window = LogWindow([])

            def evaluate(step, state, batch):
                results, _ = evaluation.evaluate(
                    eval_fn,
                    state,
                    task,
                    batches=cfg.eval_batches,
                    batch_size=cfg.eval_batch_size,
                    layout=layout,
                )
                for split, values in results.items():
                    record = writer.write(step, split, values)
                    with tqdm.external_write_mode(file=sys.stderr):
                        shown = _fmt(record, ("loss", "accuracy", "bpc"))
                        logging.info("eval %s at step %d: %s", split, step, shown)

            actions = [
                Periodic("log", cfg.log_every, log),
                Periodic("eval", cfg.eval_every, evaluate),
            ]
            if plasticity["every"] and batches is not None:
                form, measured = plasticity["form"], plasticity["rows"]
                pieces.check_alignment(program, state, batches, form, measured)
                figures = pieces.make_alignment_fn(program, form, measured)
                measure = lambda step, state, batch: writer.write(
                    step, metrics.PLASTICITY, figures(state, batch)
                )
                actions.append(Periodic("plasticity", plasticity["every"], measure, at_end=False))
            start_time = window.start = time.perf_counter()
            while step < cfg.steps:  # one iteration per jitted call
                count, length = batches["inputs"].shape[0], batches["inputs"].shape[-1]
                latest = {k: v[-1] for k, v in batches.items()}
                state, out = train_fn(state, layout.put(batches, cfg.batch_size, stacked=True))
                position += count
                following = min(cfg.steps_per_call, cfg.steps - step - count)
                if following > 0:  # build the next batches while the device works
                    batches = pieces.stacked_batches(
                        task, position, following, cfg.batch_size, rows
                    )
                out = jax.device_get(out)
                for i in range(count):
                    values = {k: float(v[i]) for k, v in out.items()}
                    window.steps.append(_checked(values, step + i + 1))
                    skipped += int(values.get("skipped", 0))
                step, window.tokens = step + count, window.tokens + count * cfg.batch_size * length
                _check_skipped(skipped, step, cfg)
                bar.update(count)
                # The bar shows what the log lines show: the mean over the log window so far.
                window_loss = window.means().get("loss", float("nan"))
                bar.set_postfix(loss=f"{window_loss:.4f}", tokens_per_s=f"{window.rate():.0f}")
                for periodic in actions:
                    if periodic.due(step, cfg.steps):
                        periodic.action(step, state, latest)
                # The unfinished log window goes with the state, so a run resumed from any
                # step logs the windows an uninterrupted one does.
                saved = {"data_position": position, "extra": {"window": window.steps}}
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
            for closing in (bar, ckpt, writer):
                if closing is not None:
                    closing.close()
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


def _fmt(record: Mapping, names: Iterable[str]) -> str:
    return " ".join(f"{n}={record[n]:.4g}" for n in names if n in record)


def _title(config) -> str:
    rules = ", ".join(f"{n}={s.rule}(every={s.every})" for n, s in config.levels.items())
    return f"{config.task.name}: {config.model.name}, {rules}"
