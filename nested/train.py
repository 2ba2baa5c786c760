"""The training loop, ``train_and_evaluate(config, workdir)``, and workdir evaluation.

One linear loop over outer steps, read top to bottom:

1. **Build**: validate the config and build the task, nested system and program
   (:func:`nested.config.build`; a bad config raises before anything is compiled).
2. **State**: initialise it, or resume from the latest readable checkpoint of
   ``<workdir>/checkpoints`` (state and data position; see :mod:`nested.checkpoint`).
3. **Loop**: each call of one jitted function runs ``train.steps_per_call`` outer steps, a
   ``lax.scan`` of ``Program.train_step`` over stacked batches. Between calls, on the host:
   the non-finite check, a log record every ``log_every`` steps (means over the window), an
   evaluation of every held-out split every ``eval_every`` steps, a checkpoint every
   ``checkpoint_every`` steps.
4. **End**: a final evaluation and checkpoint, ``curves.png``, the printed summary.

Training batch ``i`` is ``task.batch(i, batch_size)``, a pure function of ``i``, so the data
position is the next ``i`` and a resumed run sees the batches an uninterrupted one would:
on CPU it reproduces the uninterrupted run's metrics exactly.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from ml_collections import config_dict
from tqdm import tqdm

from nested import checkpoint, data, guards, memory_state, metrics
from nested import config as config_lib
from nested.config import ConfigError, Experiment
from nested.scheduler import Program, State

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"


# -- pieces (each usable alone) ---------------------------------------------------------------


def as_arrays(batch, *, extra_masks: bool = False) -> dict[str, np.ndarray]:
    """A ``nested.data.Batch`` as the dict the program takes; with ``extra_masks``, also the
    masks of sub-metrics (``in_context`` for the continual task)."""
    out = {"inputs": batch.inputs, "targets": batch.targets, "mask": batch.mask}
    if extra_masks and "in_context" in batch.extras:
        out["in_context"] = batch.extras["in_context"]
    return out


def stacked_batches(task, start: int, count: int, batch_size: int) -> dict[str, np.ndarray]:
    """Training batches ``start .. start + count - 1`` stacked on a leading axis."""
    batches = [as_arrays(task.batch(i, batch_size)) for i in range(start, start + count)]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def make_train_fn(program: Program):
    """``(state, batches) -> (state, metrics)``: ``len(batches)`` outer steps in one call."""
    return jax.jit(lambda state, batches: jax.lax.scan(program.train_step, state, batches))


def make_eval_fn(program: Program):
    """``(state, batch) -> (metrics, fast)``: the outer objective on a held-out batch, and the
    fast state the batch leaves (None unless a level carries its state across sequences).
    Extra masks in ``batch`` (``in_context``) add ``in_context_accuracy`` and
    ``memory_accuracy`` (queries answerable only from memory)."""

    def run(state: State, batch):
        main = {k: batch[k] for k in ("inputs", "targets", "mask")}
        fast = None
        if state.fast is not None:
            fast = program.start_fast(state.params, main["inputs"].shape[0], state.fast)
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

    return jax.jit(run)


def evaluate(
    eval_fn,
    state: State,
    task,
    *,
    batches: int,
    batch_size: int,
    splits: Iterable[str] | None = None,
    carry: bool = False,
) -> tuple[dict[str, dict[str, float]], object]:
    """Metrics per held-out split, averaged over ``batches`` batches weighted by the number
    of scored positions; and the final fast state.

    ``carry=False``: every batch starts from ``state.fast`` (evaluation does not write into
    the run). ``carry=True`` (a session): the fast state carries from batch to batch, split
    after split, and the one it ends with is returned, so the model keeps learning.
    """
    fast = state.fast
    results = {}
    for split in task.eval_splits if splits is None else splits:
        parts = []
        for i in range(batches):
            batch = as_arrays(task.batch(i, batch_size, split=split), extra_masks=True)
            out, new_fast = eval_fn(state.replace(fast=fast) if carry else state, batch)
            parts.append(jax.device_get(out))
            if carry:
                fast = new_fast
        results[split] = _aggregate(parts, task)
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


def init_state(exp: Experiment) -> State:
    """A fresh state: the model from ``config.seed``; carried fast states when needed."""
    batch_size = exp.config.train.batch_size if exp.carries_fast else None
    # One compiled init instead of one eager dispatch (and compile) per initialiser.
    init = jax.jit(exp.program.init, static_argnames="batch_size")
    return init(jax.random.key(exp.config.seed), batch_size=batch_size)


def _flat(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple | list) else value
    return out


def _record_config(config: config_dict.ConfigDict, workdir: Path) -> None:
    """Write ``config.json``; when resuming, warn about keys that differ from the saved one."""
    path = workdir / CONFIG_FILE
    current = json.loads(config.to_json_best_effort())
    if path.exists():
        before = _flat(json.loads(path.read_text()))
        now = _flat(current)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if changed:
            logging.warning("config differs from the one saved in %s: %s", path, changed)
    path.write_text(json.dumps(current, indent=2) + "\n")


def load_workdir_config(workdir: str | Path) -> config_dict.ConfigDict:
    """The config a run in ``workdir`` was trained with."""
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"--workdir {workdir} has no {CONFIG_FILE}; pass --config")
    return config_dict.ConfigDict(json.loads(path.read_text()))


# -- the loop ---------------------------------------------------------------------------------


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str | Path) -> dict:
    """Train the system of ``config`` in ``workdir`` (resuming if it holds checkpoints),
    evaluate it, plot the curves and return the summary (see :func:`nested.metrics.summary`).
    """
    # 1. Build: everything is validated before anything is compiled.
    exp = config_lib.build(config)
    cfg, task, program = exp.config.train, exp.task, exp.program
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _record_config(config, workdir)
    logging.info("task: %s", task.describe())
    logging.info("system: %s", exp.system)

    # 2. State: fresh, or the latest readable checkpoint.
    state = init_state(exp)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("model: %d slow parameters", n_params)
    ckpt = checkpoint.Checkpointer(
        workdir / CHECKPOINTS, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints
    )
    writer = bar = None
    try:
        restored = ckpt.restore_latest(state)
        step, position = 0, 0
        if restored is not None:
            state, step, position = restored.state, restored.step, restored.data_position
            logging.info("resumed from the checkpoint of step %d in %s", step, ckpt.directory)
        writer = metrics.MetricWriter(workdir, resume_step=step if restored else None)

        # 3. Loop: one jitted call per `steps_per_call` outer steps.
        train_fn, eval_fn = make_train_fn(program), make_eval_fn(program)
        window, window_start, tokens = [], time.perf_counter(), 0
        bar = tqdm(total=cfg.steps, initial=step, unit="step", disable=None, file=sys.stderr)
        first = min(cfg.steps_per_call, cfg.steps - step)
        batches = stacked_batches(task, position, first, cfg.batch_size) if first > 0 else None
        start_time = time.perf_counter()
        while step < cfg.steps:  # one iteration per jitted call
            count, n_tokens = len(batches["inputs"]), batches["inputs"].size
            state, out = train_fn(state, batches)
            position += count
            following = min(cfg.steps_per_call, cfg.steps - step - count)
            if following > 0:  # build the next batches while the device works
                batches = stacked_batches(task, position, following, cfg.batch_size)
            out = jax.device_get(out)
            for i in range(count):
                window.append(_checked({k: float(v[i]) for k, v in out.items()}, step + i + 1))
            step, tokens = step + count, tokens + n_tokens
            rate = tokens / max(time.perf_counter() - window_start, 1e-9)
            bar.update(count)
            bar.set_postfix(loss=f"{out['loss'][-1]:.4f}", tokens_per_s=f"{rate:.0f}")

            if step % cfg.log_every == 0 or step == cfg.steps:
                seconds = time.perf_counter() - window_start
                values = _window_means(window)
                values["learning_rate"] = float(exp.schedule(step - 1))
                values["tokens_per_s"] = tokens / seconds
                record = writer.write(step, metrics.TRAIN, values)
                shown = ("loss", "accuracy", "grad_norm", "tokens_per_s")
                logging.info("step %d/%d: %s", step, cfg.steps, _fmt(record, shown))
                window, window_start, tokens = [], time.perf_counter(), 0
            if step % cfg.eval_every == 0 or step == cfg.steps:
                _evaluate_and_log(eval_fn, state, task, cfg, writer, step)
            ckpt.save(step, state, data_position=position, force=step == cfg.steps)
        if restored is not None and restored.step == cfg.steps:
            logging.info("the run in %s is complete (step %d)", workdir, step)
        train_seconds = time.perf_counter() - start_time
    finally:
        if bar is not None:
            bar.close()
        ckpt.close()
        if writer is not None:
            writer.close()

    # 4. End: plot and summary.
    records = metrics.read(workdir)
    plot = metrics.plot(records, workdir / metrics.PLOT_FILE, title=_title(config))
    result = metrics.summary(records)
    result.update(plot=str(plot), train_seconds=train_seconds)
    print(metrics.format_summary(result))
    print(f"curves: {plot}")
    return result


def _checked(values: dict[str, float], step: int) -> dict[str, float]:
    """One step's metrics, after the health flags of :mod:`nested.guards` are checked: a
    non-finite step stops the run, unless the program skips such steps (``skipped = 1``)."""
    message = guards.failure(values, step)
    if message is not None and not values.get("skipped"):
        raise guards.NonFiniteError(
            f"{message}; the run stopped (lower optimizer.learning_rate, set "
            f"optimizer.grad_clip, or skip such steps with train.skip_nonfinite=True)"
        )
    return {k: v for k, v in values.items() if not k.startswith(metrics.CHECKS_PREFIX)}


def _window_means(window: list[dict[str, float]]) -> dict[str, float]:
    """Means over the steps of a log window (skipped steps excluded; their count kept)."""
    kept = [v for v in window if not v.get("skipped")]
    values = metrics.mean(kept) if kept else {}
    if "skipped" in window[0]:
        values["skipped"] = float(sum(v["skipped"] for v in window))
    return values


def _evaluate_and_log(eval_fn, state, task, cfg, writer, step) -> None:
    results, _ = evaluate(
        eval_fn, state, task, batches=cfg.eval_batches, batch_size=cfg.eval_batch_size
    )
    for split, values in results.items():
        record = writer.write(step, split, values)
        shown = ("loss", "accuracy", "bpc")
        logging.info("eval %s at step %d: %s", split, step, _fmt(record, shown))


def _fmt(record: Mapping, names: Iterable[str]) -> str:
    return " ".join(f"{n}={record[n]:.4g}" for n in names if n in record)


def _title(config) -> str:
    rules = ", ".join(f"{n}={s.rule}(every={s.every})" for n, s in config.levels.items())
    return f"{config.task.name}: {config.model.name}, {rules}"


# -- evaluating a workdir ---------------------------------------------------------------------


def evaluate_workdir(
    config: config_dict.ConfigDict | None,
    workdir: str | Path,
    *,
    load_memory: str | None = None,
    save_memory: str | None = None,
) -> dict:
    """Evaluate the latest checkpoint of ``workdir`` on every held-out split.

    ``config``: the run's config (None: the one saved in the workdir). With ``load_memory``
    or ``save_memory`` the evaluation is a *session*: the carried fast state starts from the
    memory state saved at ``load_memory`` (else the checkpoint's), carries through every
    eval batch, and is saved at ``save_memory`` when the session ends
    (:mod:`nested.memory_state`). Returns the summary and writes ``eval.json``.
    """
    workdir = Path(workdir)
    exp = config_lib.build(config if config is not None else load_workdir_config(workdir))
    cfg = exp.config.train
    directory = workdir / CHECKPOINTS
    if not directory.is_dir():
        raise checkpoint.CheckpointError(f"no checkpoints in {directory}; train a run there first")
    session = load_memory is not None or save_memory is not None
    if session and not exp.carries_fast:
        names = list(exp.config.levels.keys())
        raise ConfigError(
            f"a memory session needs a level with persist='stream'; levels {names} restart at "
            f"every sequence (set --config.levels.<name>.persist=stream and retrain)"
        )
    state = init_state(exp)
    every, keep = cfg.checkpoint_every, cfg.keep_checkpoints
    with checkpoint.Checkpointer(directory, every=every, keep=keep) as ckpt:
        restored = ckpt.restore_latest(state)
    if restored is None:
        raise checkpoint.CheckpointError(f"no readable checkpoint in {directory}")
    state = restored.state
    if load_memory is not None:
        state = state.replace(fast=memory_state.load(load_memory, like=state.fast))
    results, fast = evaluate(
        make_eval_fn(exp.program),
        state,
        exp.task,
        batches=cfg.eval_batches,
        batch_size=cfg.eval_batch_size,
        carry=session,
    )
    if save_memory is not None:
        memory_state.save(save_memory, fast)
    records = [{"step": restored.step, "split": s, **v} for s, v in results.items()]
    result = metrics.summary(records)
    (workdir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(metrics.format_summary(result))
    return result
