"""Continual key-value stream: the mapping from keys to values shifts from task to task.

There are ``num_tasks`` tasks over one shared key set, key tokens 1..K (K = ``num_keys``).
Task j is a one-to-one map f_j from keys to value tokens in [V//2, V): f_0 is random, and
f_j is f_{j-1} with ``remap_fraction`` of the keys (chosen at random, at least one) moved to
values f_{j-1} did not use, so every remapped key changes value at the boundary.

What the model sees. Each sequence (length T = 2(P + Q)) is

    k_1 f(k_1) ... k_P f(k_P) | q_1 f(q_1) ... q_Q f(q_Q)
    \\__ P presented pairs __/   \\______ Q queries _____/

with P distinct presented keys and Q distinct queried keys, each drawn uniformly from the
K keys independently (so a query may or may not repeat a presented key), all under the
current task's f. The answer f(q_i) is fed right after q_i (teacher forcing): the stream is
also the feedback an online learner writes from. Training batch ``index`` comes entirely from
task ``task_at(index) = (index // switch_every) % num_tasks``: the task switches every
``switch_every`` batches, cycling after the last one (train ``num_tasks * switch_every`` steps
for one pass). A loop that carries fast states across sequences carries row r of one batch
into row r of the next, so every row's memory sees a stream of sequences of the current task.

What is measured. Targets and mask are set at the Q query positions only (target
f_j(q_i)). Extras: ``task_id`` (B,) int32, and ``in_context`` (B, T) float32, 1 at queries
whose key was presented earlier in the same sequence. Accuracy on ``in_context`` queries is
in-context recall; on the others (mask - in_context) it is recall from memory, possible only
from what persisted from earlier sequences (fast states kept across sequences, or slow
weights). Eval split ``task{k}`` gives batches of task k at any time: accuracy on task k
after training has moved on to later tasks measures forgetting (the memory part is the
meaningful one; evaluate on a copy of the fast states so evaluation does not write into the
training state).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from nested.data.batch import (
    Batch,
    check_request,
    field_error,
    make_batch,
    render_example,
    rng_for,
    sample_without_replacement,
)


@dataclasses.dataclass(frozen=True)
class ContinualTask:
    """A stream of key-value tasks with shifting mappings; see the module docstring.

    Fields:
      vocab_size: V; key tokens 1..num_keys, value tokens in [V//2, V).
      num_keys: K, the shared key set.
      num_pairs: P, pairs presented at the start of each sequence (0 allowed: queries only).
      num_queries: Q, queried keys per sequence.
      num_tasks: number of distinct mappings.
      switch_every: training batches per task.
      remap_fraction: share of keys whose value changes at each task boundary, in (0, 1].
      seed: base seed; batch ``i`` of split ``s`` depends on (seed, s, i) only.
    """

    vocab_size: int = 8192
    num_keys: int = 64
    num_pairs: int = 16
    num_queries: int = 16
    num_tasks: int = 5
    switch_every: int = 200
    remap_fraction: float = 1.0
    seed: int = 0

    name: ClassVar[str] = "continual"

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        for field, low in [("num_tasks", 1), ("switch_every", 1), ("num_queries", 1)]:
            if getattr(self, field) < low:
                raise field_error(self.name, field, getattr(self, field), f"use >= {low}")
        if self.num_pairs < 0:
            raise field_error(self.name, "num_pairs", self.num_pairs, "use >= 0")
        if self.num_keys < max(self.num_pairs, self.num_queries):
            raise field_error(
                self.name,
                "num_keys",
                self.num_keys,
                "draws distinct keys per sequence: use num_keys >= max(num_pairs, num_queries)",
            )
        if not 0.0 < self.remap_fraction <= 1.0:
            raise field_error(self.name, "remap_fraction", self.remap_fraction, "use 0 < f <= 1")
        half = self.vocab_size // 2
        needed = max(2 * (self.num_keys + 1), 2 * (self.num_keys + self._num_remapped))
        if self.num_keys > half - 1 or self.num_keys + self._num_remapped > self.vocab_size - half:
            raise field_error(
                self.name,
                "vocab_size",
                self.vocab_size,
                f"{self.num_keys} keys, each remapped to an unused value, need vocab_size >= "
                f"{needed}",
            )

    @property
    def _num_remapped(self) -> int:
        return max(1, round(self.remap_fraction * self.num_keys))

    @property
    def seq_len(self) -> int:
        """T = 2 (num_pairs + num_queries)."""
        return 2 * (self.num_pairs + self.num_queries)

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return tuple(f"task{k}" for k in range(self.num_tasks))

    def task_at(self, index: int) -> int:
        """The task of training batch ``index``."""
        return (int(index) // self.switch_every) % self.num_tasks

    def mapping(self, task_id: int) -> np.ndarray:
        """(num_keys,) int32: the value token of key token 1 + i under task ``task_id``."""
        if not 0 <= task_id < self.num_tasks:
            raise ValueError(f"task_id={task_id} is out of range [0, {self.num_tasks})")
        return self._mappings[task_id].copy()

    @functools.cached_property
    def _mappings(self) -> np.ndarray:
        half = self.vocab_size // 2
        values = np.arange(half, self.vocab_size)
        rng = rng_for(self.seed, "mapping", 0)
        maps = [values[sample_without_replacement(rng, values.size, self.num_keys, rows=1)[0]]]
        for j in range(1, self.num_tasks):
            rng = rng_for(self.seed, "mapping", j)
            moved = sample_without_replacement(rng, self.num_keys, self._num_remapped, rows=1)[0]
            free = np.setdiff1d(values, maps[-1])
            new = free[sample_without_replacement(rng, free.size, moved.size, rows=1)[0]]
            maps.append(maps[-1].copy())
            maps[-1][moved] = new
        return np.stack(maps).astype(np.int32)

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split`` ("train": task ``task_at(index)``; "task{k}": task k)."""
        check_request(self, index, batch_size, split)
        task_id = self.task_at(index) if split == "train" else int(split.removeprefix("task"))
        return self._sequences(rng_for(self.seed, split, int(index)), batch_size, task_id)

    def _sequences(self, rng: np.random.Generator, rows: int, task_id: int) -> Batch:
        p, q, f = self.num_pairs, self.num_queries, self._mappings[task_id]
        presented = sample_without_replacement(rng, self.num_keys, p, rows=rows)
        queried = sample_without_replacement(rng, self.num_keys, q, rows=rows)
        inputs = np.zeros((rows, self.seq_len), dtype=np.int64)
        inputs[:, 0 : 2 * p : 2] = 1 + presented
        inputs[:, 1 : 2 * p : 2] = f[presented]
        inputs[:, 2 * p :: 2] = 1 + queried
        inputs[:, 2 * p + 1 :: 2] = f[queried]
        targets = np.zeros_like(inputs)
        targets[:, 2 * p :: 2] = f[queried]
        mask = np.zeros(inputs.shape, dtype=np.float32)
        mask[:, 2 * p :: 2] = 1.0
        in_context = np.zeros(inputs.shape, dtype=np.float32)
        in_context[:, 2 * p :: 2] = (queried[:, :, None] == presented[:, None, :]).any(axis=2)
        return make_batch(
            inputs,
            targets,
            mask,
            task_id=np.full(rows, task_id, dtype=np.int32),
            in_context=in_context,
        )

    def describe(self) -> str:
        small = dataclasses.replace(self, num_keys=6, num_pairs=3, num_queries=3, vocab_size=32)
        example = render_example(small._sequences(np.random.default_rng(0), 1, 0))
        return (
            f"Continual KV stream: {self.num_tasks} tasks over {self.num_keys} keys, switching "
            f"every {self.switch_every} train batches, {self.remap_fraction:.0%} of keys "
            f"remapped per switch; each sequence = {self.num_pairs} presented pairs k f(k), "
            f"then {self.num_queries} queries q f(q) scored at q (T={self.seq_len}).\n"
            f"Example (V=32, 6 keys, 3 pairs, 3 queries):\n{example}"
        )
