"""The batch/task protocol shared by every data task, and the seeded randomness behind it.

A task is a frozen dataclass (its config) whose ``batch(index, batch_size, split=...)`` returns
batch number ``index`` of a split as a pure function of ``(seed, split, index, batch_size)``.
There is no iterator state: the data position of a run is the index of the next batch, so a
run restored at step ``s`` with data position ``i`` draws exactly the batches an uninterrupted
run would have drawn. Every split (``"train"`` and the held-out splits in ``task.eval_splits``)
is a separate random stream, so held-out batch ``i`` is the same set of sequences at every
evaluation.

Batches are numpy (no JAX needed); a ``Batch`` is a NamedTuple, hence a JAX pytree as is.
Determinism holds for a given numpy version (numpy does not promise identical ``Generator``
streams across releases).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from nested.core.batch import Batch  # the batch a program takes, and its checks


class Task(Protocol):
    """What the training loop may rely on for any task in ``nested.data.TASKS``."""

    name: str
    vocab_size: int
    seed: int

    @property
    def seq_len(self) -> int:
        """Length T of every training batch (the longest eval split may be longer)."""
        ...

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """Names of the held-out splits accepted by ``batch(..., split=...)``."""
        ...

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch number ``index`` of ``split``, a pure function of (seed, split, index)."""
        ...

    def describe(self) -> str:
        """Human-readable layout of a sequence with a rendered example."""
        ...


# Extras a training loop passes on to the program: ``reset (B, T)``, set at the first position
# of the rows whose stream starts anew (a new agent): their carried fast state restarts;
# ``documents (B, T)`` int, the document of each position of a packed row: every fast level
# restarts where a new one starts inside the row.
STREAM_EXTRAS = ("reset", "documents")


def make_batch(
    inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray, **extras: np.ndarray
) -> Batch:
    """Assembles a ``Batch`` with the canonical dtypes (int32 tokens, float32 mask)."""
    return Batch(
        inputs=np.ascontiguousarray(inputs, dtype=np.int32),
        targets=np.ascontiguousarray(targets, dtype=np.int32),
        mask=np.ascontiguousarray(mask, dtype=np.float32),
        extras=dict(extras),
    )


def rng_for(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of batch ``index`` of ``split``: independent streams per (seed, split, index).

    The split name enters through its CRC32, so streams are stable across processes (unlike
    Python's salted ``hash``).
    """
    return np.random.default_rng([seed, zlib.crc32(split.encode()), index])


def check_request(task: Task, index: int, batch_size: int, split: str) -> None:
    """Raises ``ValueError`` for a negative index, a non-positive batch size or an unknown split."""
    if not isinstance(index, int | np.integer) or index < 0:
        raise ValueError(f"index must be a non-negative int (the batch number), got {index!r}")
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if split != "train" and split not in task.eval_splits:
        raise ValueError(
            f"split={split!r} is not a split of task {task.name!r}; "
            f"allowed: {('train', *task.eval_splits)}"
        )


def iterate(
    task: Task, *, batch_size: int, start: int = 0, split: str = "train"
) -> Iterator[tuple[int, Batch]]:
    """Yields ``(index, batch)`` for index = start, start + 1, ...; resume from the next index."""
    index = start
    while True:
        yield index, task.batch(index, batch_size, split=split)
        index += 1


def sample_without_replacement(
    rng: np.random.Generator, n: int, k: int, *, rows: int, weights: np.ndarray | None = None
) -> np.ndarray:
    """Draws, per row, k distinct integers of [0, n) in order of draw: (rows, k) int64.

    With ``weights`` (shape (n,), positive) the draw is successive sampling without
    replacement, each next item chosen with probability proportional to its weight among
    the items left (as ``np.random.choice(n, k, replace=False, p=w / w.sum())``). It is
    vectorised by the exponential race (Efraimidis and Spirakis 2006): item i gets the clock
    E_i / w_i with E_i ~ Exp(1), and the k smallest clocks, in increasing order, are the draw.
    """
    if k == 0:
        return np.zeros((rows, 0), dtype=np.int64)
    clocks = rng.exponential(size=(rows, n))
    if weights is not None:
        clocks = clocks / weights[None, :]
    first = np.argpartition(clocks, k - 1, axis=1)[:, :k]
    order = np.argsort(np.take_along_axis(clocks, first, axis=1), axis=1)
    return np.take_along_axis(first, order, axis=1)


def field_error(task: str, field: str, value: object, requirement: str) -> ValueError:
    """The ``ValueError`` for a bad config field, naming the task, the field and the fix."""
    return ValueError(f"{task}: {field}={value!r} is invalid: {requirement}")


def render_example(batch: Batch, *, row: int = 0, max_tokens: int = 40) -> str:
    """Two aligned lines, inputs and targets of one row; unscored targets print as '.'."""
    inputs = batch.inputs[row, :max_tokens]
    targets = batch.targets[row, :max_tokens]
    scored = batch.mask[row, :max_tokens] > 0
    cells = [
        (str(x), str(y) if s else ".") for x, y, s in zip(inputs, targets, scored, strict=True)
    ]
    width = [max(len(a), len(b)) for a, b in cells]
    more = " ..." if batch.inputs.shape[1] > max_tokens else ""
    line_in = " ".join(a.rjust(w) for (a, _), w in zip(cells, width, strict=True))
    line_tg = " ".join(b.rjust(w) for (_, b), w in zip(cells, width, strict=True))
    return f"  inputs:  {line_in}{more}\n  targets: {line_tg}{more}"
