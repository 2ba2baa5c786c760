"""Deployment: what a trained model learns after it ships.

The slow weights are frozen. The fast levels that carry their state across sequences
(``persist="stream"``) carry it from session to session; the others restart at every
sequence, as in training. A *session* is a few sequences (batches) of one task: each batch row
is an independent stream (an agent, a user), so a batch of ``B`` rows runs ``B`` sessions side
by side and statistics over sessions are statistics over rows. Sessions are drawn from a task
sequence: tasks with task ids (``task.num_tasks``, splits ``"task<k>"``: the continual stream)
give batches per task; a stream without task boundaries gives batches per window of its own
order. Evaluations run from a copy of the fast state and do not write into it.

This is the setting of the functional-plasticity measurements (:mod:`nested.plasticity`):
the continual-learning matrix, the regret utility and the capacity over a stream run on it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nested import data
from nested.core.level import LevelState
from nested.learn import objectives

# Held-out batches are drawn from this index on, so they never meet a session's batches.
HELD_OUT = 1_000_000
EXTRAS = ("in_context",)


def row_metrics(logits: jax.Array, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per row ``(B,)``: summed next-token loss, scored positions, correct predictions, and with
    an ``in_context`` mask the correct answers and positions of the queries answerable only
    from memory (``mask - in_context``)."""
    mask = batch["mask"].astype(logits.dtype)
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(logits.dtype)
    out = {
        "loss": jnp.sum(objectives.token_cross_entropy(logits, batch), axis=1),
        "count": jnp.sum(mask, axis=1),
        "correct": jnp.sum(correct * mask, axis=1),
    }
    if "in_context" in batch:
        memory = mask - batch["in_context"].astype(logits.dtype)
        out["memory_correct"] = jnp.sum(correct * memory, axis=1)
        out["memory_count"] = jnp.sum(memory, axis=1)
    return out


def _ratios(total: Mapping[str, Any]) -> dict[str, Any]:
    """Loss per scored position and the accuracies of summed :func:`row_metrics` (floats, or
    arrays of rows: a row that scored none of a kind gives nan there)."""

    def ratio(a, b):
        b = np.asarray(b, np.float64)
        return np.divide(a, b, out=np.full(b.shape, np.nan), where=b > 0)

    out = {
        "loss": ratio(total["loss"], total["count"]),
        "accuracy": ratio(total["correct"], total["count"]),
    }
    if "memory_count" in total:
        out["memory_accuracy"] = ratio(total["memory_correct"], total["memory_count"])
        out["in_context_accuracy"] = ratio(
            total["correct"] - total["memory_correct"], total["count"] - total["memory_count"]
        )
    return out


def rates(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Loss per scored position, accuracy, and from-memory and in-context accuracy where
    counted, pooled over the rows and batches of ``parts`` (:func:`row_metrics` outputs)."""
    out = {key: float(value) for key, value in _ratios(_summed(parts, np.sum)).items()}
    for key in ("loss", "accuracy"):  # nothing scored: 0
        out[key] = 0.0 if np.isnan(out[key]) else out[key]
    return {key: value for key, value in out.items() if not np.isnan(value)}


def row_rates(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """:func:`rates` of each row ``(B,)`` (an agent) over the batches of ``parts``; nan where a
    row scored none of a kind."""
    return _ratios(_summed(parts, lambda value: value))


def _summed(parts: Iterable[Mapping[str, np.ndarray]], reduce) -> dict[str, Any]:
    """Each :func:`row_metrics` key summed over ``parts``, every part's value ``reduce``-d
    first (``np.sum``: over rows too; the identity: per row)."""
    total = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + np.asarray(reduce(value), np.float64)
    return total


class Deployment:
    """A compiled program deployed with frozen slow ``params`` over ``batch_size`` streams.

    ``fresh()`` is the fast state a stream starts from (the learned initial states);
    ``session(fast, batches)`` learns from the batches in order and returns the fast state
    they leave and each batch's :func:`row_metrics`; ``evaluate(fast, batches)`` scores
    batches from ``fast`` without keeping what they write. One jitted step serves all three.
    """

    def __init__(self, program, params, batch_size: int):
        carried = [level.name for level in program.system.fast_levels if level.persist == "stream"]
        if not carried:
            names = [level.name for level in program.system.fast_levels]
            raise ValueError(
                f"deployment: no level carries its state across sessions (levels {names} have "
                f"persist='sequence'); set --config.levels.<name>.persist=stream and retrain"
            )
        self.program, self.params, self.batch_size = program, params, batch_size
        self._fresh = jax.jit(lambda params: program.start_fast(params, batch_size))
        self._step = jax.jit(self._run)

    def _run(self, params, fast, batch):
        fast = self.program.start_fast(params, self.batch_size, fast)
        logits, fast = self.program.apply(
            params, batch["inputs"], fast, targets=batch["targets"], mask=batch.get("mask")
        )
        return fast, row_metrics(logits.astype(jnp.float32), batch)

    def fresh(self):
        return self._fresh(self.params)

    def reset(self, fast, levels):
        """``fast`` with the states of the levels named in ``levels`` restarted (fresh)."""
        pick = lambda new, old: new if isinstance(new, LevelState) and new.level in levels else old
        is_state = lambda x: isinstance(x, LevelState)
        return jax.tree.map(pick, self.fresh(), fast, is_leaf=is_state)

    def with_params(self, params) -> Deployment:
        """This deployment with other slow weights, its compiled steps shared."""
        other = copy.copy(self)
        other.params = params
        return other

    def step(self, fast, batch: Mapping[str, Any]):
        """One batch from ``fast``: ``(fast it leaves, row metrics as NumPy)``."""
        self.program.check_batch({k: batch[k] for k in ("inputs", "targets", "mask")})
        if batch["inputs"].shape[0] != self.batch_size:
            raise ValueError(
                f"batch: {batch['inputs'].shape[0]} rows; this deployment runs "
                f"{self.batch_size} streams"
            )
        fast, metrics = self._step(self.params, fast, batch)
        return fast, jax.device_get(metrics)

    def session(self, fast, batches: Iterable[Mapping[str, Any]]):
        """Learn from ``batches`` in order: ``(fast state after them, [row metrics per batch])``."""
        out = []
        for batch in batches:
            fast, metrics = self.step(fast, batch)
            out.append(metrics)
        return fast, out

    def evaluate(self, fast, batches: Iterable[Mapping[str, Any]], *, rows: bool = False):
        """:func:`rates` of ``batches``, each scored from ``fast`` (nothing kept); with
        ``rows``, also the :func:`row_rates` of every row: ``(rates, row rates)``."""
        parts = [self.step(fast, batch)[1] for batch in batches]
        return (rates(parts), row_rates(parts)) if rows else rates(parts)


def has_task_ids(task) -> bool:
    """Whether ``task`` has task ids: ``num_tasks`` and a split ``"task<k>"`` for each."""
    count = getattr(task, "num_tasks", None)
    return count is not None and all(f"task{k}" in task.eval_splits for k in range(count))


def task_batches(task, batch_size: int) -> Callable[[int, int], dict]:
    """``(task_id, index) -> batch`` of a task with task ids (:func:`has_task_ids`); raises
    ``ValueError`` for a task without them."""
    if not has_task_ids(task):
        raise ValueError(
            f"task {task.name!r} has no task ids (num_tasks and 'task<k>' splits), which the "
            f"continual-learning matrix needs; use windows of its stream instead (windows=...)"
        )
    count = task.num_tasks

    def batch(task_id: int, index: int) -> dict:
        if not 0 <= task_id < count:
            raise ValueError(f"tasks: task id {task_id} is out of range [0, {count})")
        made = task.batch(index, batch_size, split=f"task{task_id}")
        return data.as_arrays(made, extras=EXTRAS)

    return batch


def stream_batches(task, batch_size: int, split: str = "train") -> Callable[[int], dict]:
    """``index -> batch``: the task's stream in its own order (``split``)."""
    return lambda index: data.as_arrays(task.batch(index, batch_size, split=split), extras=EXTRAS)
