"""Evaluation: the held-out splits of a task scored with a program's eval function
(:func:`evaluate`, also the training loop's), and the evaluation of a run's latest checkpoint
(:func:`evaluate_workdir`, ``experiments/eval.py``), alone or as a memory session.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import numpy as np
from ml_collections import config_dict
from tqdm import tqdm

from nested import data, files
from nested.core.scheduler import State
from nested.run import config as config_lib
from nested.run import distributed, fingerprint, memory_state, metrics, pieces, rundir, sharding
from nested.run.config import ConfigError


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
            pieces.check_arrays(batch, task.vocab_size, where, grid=pieces.document_grid(task))
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
    directory = rundir.check_run(workdir)
    exp = config_lib.build(config if config is not None else rundir.load_workdir_config(workdir))
    rundir.check_same_config(exp.config, workdir)
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
    pieces.check_task(exp.task)
    if load_memory is not None:
        _check_memory_is_read(exp.task, cfg.eval_batch_size, load_memory)
    layout = pieces.make_layout(exp)
    restored = rundir.restore_latest(exp, directory, layout)
    state, model = restored.state, fingerprint.of(exp.config, restored.step)
    if load_memory is not None:
        fast = memory_state.load(load_memory, like=state.fast, fingerprint=model)
        state = state.replace(fast=fast)
    results, fast = evaluate(
        pieces.make_eval_fn(exp.program, layout),
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
        path = workdir / rundir.SESSIONS_FILE
        with path.open("a") as f:
            f.write(json.dumps(result) + "\n")
    else:
        path = workdir / rundir.EVAL_FILE
        if distributed.is_primary():
            files.write_atomic(path, json.dumps(result, indent=2) + "\n")
    if distributed.is_primary():
        print(metrics.format_summary(result))
        print(f"results: {path}")
    distributed.finish()
    return result
