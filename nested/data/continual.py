"""Continual key-value stream: per-row key -> value mappings that shift from task to task.

There are ``num_tasks`` tasks over one shared key set, key tokens 1..K (K = ``num_keys``).
Every batch row r (its 0-based index inside a batch) has its own chain of one-to-one maps
f_j^r from keys to value tokens in [V//2, V): f_0^r is random, and f_j^r is f_{j-1}^r with
``remap_fraction`` of the keys (chosen at random, at least one) moved to values f_{j-1}^r did
not use, so every remapped key changes value at the boundary. Row r's chain depends on
(seed, r) only, not on the batch size, the batch index or the split.

Disjoint keys. With ``disjoint_keys=True`` task j has keys of its own instead, key tokens
1 + jK .. (j + 1)K, and f_j^r is a one-to-one map of them drawn independently of the other
tasks (``remap_fraction`` does not apply). No later task changes an earlier task's answers, so
nothing forces forgetting: a memory that keeps every pair it was shown recalls every earlier
task, and whatever a model loses of them is interference in its own state. This is the stream
on which retention can pay (the shared-key stream rewards tracking the current mapping only).

Review queries. With ``review_queries = R > 0`` (disjoint keys only: a shared key would
have two answers) the last R queries of a training sequence ask keys of the tasks the row's
agent met earlier in the last pass over the tasks (uniform over their keys, answered by their
maps, never presented in the sequence), once there is one: the training loss then rewards
keeping old pairs, as a stream that returns to earlier tasks does. Eval splits have none, so
``task{k}`` still scores task k's own keys.

Why per row. With one global mapping per task, slow weights (trained at every step) simply
memorise the current task's mapping, ignore the context and the fast memory, and score 0% on
earlier tasks even on queries whose pair is in the sequence. Slow weights are shared by all
rows and do not see the row index, so they cannot hold independent per-row mappings: the
mapping of row r is learnable only from the stream, i.e. from the pairs presented in the
same sequence and from a fast state carried across the earlier sequences of row r.

What the model sees. Each sequence (length T = 2(P + Q)) is

    k_1 f(k_1) ... k_P f(k_P) | q_1 f(q_1) ... q_Q f(q_Q)
    \\__ P presented pairs __/   \\______ Q queries _____/

with P distinct presented keys and Q distinct queried keys, each drawn uniformly from the
K keys independently (so a query may or may not repeat a presented key), all under the
current task's mapping of the row, f = f_j^r. The answer f(q_i) is fed right after q_i
(teacher forcing): the stream is also the feedback an online learner writes from. Training
batch ``index`` comes entirely from task ``task_at(index) = (index // switch_every) %
num_tasks``: the task switches every ``switch_every`` batches, cycling after the last one
(train ``num_tasks * switch_every`` steps for one pass). A loop that carries fast states
across sequences carries row r of one batch into row r of the next, so every row's memory
sees a stream of sequences of its own mapping under the current task.

Agents. With ``agent_every = N > 0`` every row gets a new agent every N training batches:
batch ``index`` belongs to agent ``index // N`` of each row, whose chain of maps is drawn anew,
and the batch's ``reset`` extra (B, T) is 1 at the first position of an agent's first batch,
so a loop that honours it (:meth:`nested.Program.train_step`) restarts the rows' fast state
from the learned initial state there. The slow weights then cannot follow the rows' mappings
(they change with every agent); they can only learn how a fast state learns an agent. With
``N = 0`` (the default) each row keeps one agent for the whole run, and the slow weights,
updated at every batch, can follow the current mapping of every row through the row's carried
state: measure with frozen slow weights (``experiments/plasticity.py``) what the fast state
itself learns.

What is measured. Targets and mask are set at the Q query positions only (target
f_j^r(q_i)). Extras: ``task_id`` (B,) int32, and ``in_context`` (B, T) float32, 1 at queries
whose key was presented earlier in the same sequence. Accuracy on ``in_context`` queries is
in-context recall; on the others (mask - in_context) it is recall from memory, possible only
from the fast state carried across the row's earlier sequences (slow weights cannot hold a
per-row mapping). Eval split ``task{k}`` gives batches of task k at any time, row r under
f_k^r: accuracy on task k after training has moved on to later tasks measures forgetting
(the memory part is the meaningful one; evaluate on a copy of the fast states so evaluation
does not write into the training state). With agents, split ``task{k}`` is a held-out agent's
first sequence under task k (``reset`` set: in-context recall of a fresh agent).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
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
    """A stream of key-value tasks with shifting per-row mappings; see the module docstring.

    Fields:
      vocab_size: V; key tokens 1..num_keys, value tokens in [V//2, V).
      num_keys: K, the shared key set.
      num_pairs: P, pairs presented at the start of each sequence (0 allowed: queries only).
      num_queries: Q, queried keys per sequence.
      num_tasks: number of distinct mappings.
      switch_every: training batches per task.
      remap_fraction: share of keys whose value changes at each task boundary, in (0, 1].
      agent_every: training batches per agent (0: one agent per row for the whole run).
      disjoint_keys: every task its own ``num_keys`` keys (module docstring).
      review_queries: training queries per sequence asked of earlier tasks (module docstring).
      seed: base seed; batch ``i`` of split ``s`` depends on (seed, s, i) only.
    """

    vocab_size: int = 8192
    num_keys: int = 64
    num_pairs: int = 16
    num_queries: int = 16
    num_tasks: int = 5
    switch_every: int = 200
    remap_fraction: float = 1.0
    agent_every: int = 0
    disjoint_keys: bool = False
    review_queries: int = 0
    seed: int = 0

    name: ClassVar[str] = "continual"

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        for field, low in [
            ("num_tasks", 1),
            ("switch_every", 1),
            ("num_queries", 1),
            ("agent_every", 0),
        ]:
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
        if not isinstance(self.disjoint_keys, bool):
            raise field_error(self.name, "disjoint_keys", self.disjoint_keys, "use True or False")
        if self.disjoint_keys and self.remap_fraction != 1.0:
            raise field_error(
                self.name,
                "remap_fraction",
                self.remap_fraction,
                "with disjoint_keys every task has new keys, so nothing is remapped: leave it 1.0",
            )
        if not 0 <= self.review_queries <= self.num_queries:
            raise field_error(
                self.name, "review_queries", self.review_queries, "use 0 <= R <= num_queries"
            )
        if self.review_queries and not self.disjoint_keys:
            raise field_error(
                self.name,
                "review_queries",
                self.review_queries,
                "a key shared by the tasks has an answer per task: set disjoint_keys=True",
            )
        half = self.vocab_size // 2
        if self.disjoint_keys:
            keys, values = self.num_tasks * self.num_keys, self.num_keys
            what = f"{self.num_tasks} tasks of {self.num_keys} keys of their own"
        else:
            keys, values = self.num_keys, self.num_keys + self._num_remapped
            what = f"{self.num_keys} keys, each remapped to an unused value,"
        if keys > half - 1 or values > self.vocab_size - half:
            needed = max(2 * (keys + 1), 2 * values)
            raise field_error(
                self.name, "vocab_size", self.vocab_size, f"{what} need vocab_size >= {needed}"
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

    def keys(self, task_id: int) -> np.ndarray:
        """(num_keys,) int32: the key tokens of task ``task_id``: 1 .. K, or 1 + jK .. (j + 1)K
        for task j with ``disjoint_keys``."""
        return self._key_tokens(task_id, np.arange(self.num_keys)).astype(np.int32)

    def _key_tokens(self, task_id, index):
        """The token of key ``index`` (0-based) of task ``task_id`` (ints or arrays)."""
        return 1 + (np.asarray(task_id) * self.num_keys if self.disjoint_keys else 0) + index

    def mapping(self, task_id: int, row: int = 0, agent: int = 0) -> np.ndarray:
        """(num_keys,) int32: the value token of key token ``keys(task_id)[i]`` in batch
        row ``row`` under task ``task_id`` (f_{task_id}^{row} of the module docstring), for the
        row's agent ``agent`` (``-1``: the held-out agent of the eval splits)."""
        if not 0 <= task_id < self.num_tasks:
            raise ValueError(f"task_id={task_id} is out of range [0, {self.num_tasks})")
        if not isinstance(row, int | np.integer) or row < 0:
            raise ValueError(f"row={row!r} must be a non-negative int (a batch row index)")
        return self._chain(int(row), int(agent))[task_id].astype(np.int32)

    def _chain(self, row: int, agent: int = 0) -> np.ndarray:
        """(num_tasks, num_keys) int64: the maps f_0^row .. f_{num_tasks-1}^row of row
        ``row``'s agent ``agent``, drawn from the generator of (seed, "mapping", row) alone for
        agent 0 (of (seed, "mapping/<agent>", row) for the others); drawn once."""
        if (row, agent) not in self._chains:
            self._chains[row, agent] = self._draw_chain(row, agent)
        return self._chains[row, agent]

    @functools.cached_property
    def _chains(self) -> dict[tuple[int, int], np.ndarray]:
        return {}

    def _draw_chain(self, row: int, agent: int) -> np.ndarray:
        half = self.vocab_size // 2
        values = np.arange(half, self.vocab_size)
        rng = rng_for(self.seed, "mapping" if agent == 0 else f"mapping/{agent}", row)
        maps = np.empty((self.num_tasks, self.num_keys), dtype=np.int64)

        def fresh_map() -> np.ndarray:
            return values[sample_without_replacement(rng, values.size, self.num_keys, rows=1)[0]]

        maps[0] = fresh_map()
        for j in range(1, self.num_tasks):
            if self.disjoint_keys:
                maps[j] = fresh_map()
                continue
            moved = sample_without_replacement(rng, self.num_keys, self._num_remapped, rows=1)[0]
            unused = np.ones(values.size, dtype=bool)
            unused[maps[j - 1] - half] = False
            free = values[unused]
            maps[j] = maps[j - 1]
            maps[j, moved] = free[sample_without_replacement(rng, free.size, moved.size, rows=1)[0]]
        return maps

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split`` ("train": task ``task_at(index)``; "task{k}": task k);
        row r follows ``mapping(task, r)``."""
        check_request(self, index, batch_size, split)
        rng = rng_for(self.seed, split, int(index))
        if split != "train":
            agent = -1 if self.agent_every else 0
            return self._sequences(rng, batch_size, int(split.removeprefix("task")), agent, True)
        agent = int(index) // self.agent_every if self.agent_every else 0
        new = self.agent_every > 0 and int(index) % self.agent_every == 0
        earlier = self.earlier(index) if self.review_queries else ()
        return self._sequences(rng, batch_size, self.task_at(index), agent, new, earlier)

    def earlier(self, index: int) -> list[int]:
        """The tasks other than batch ``index``'s that the rows' agent met in the last pass
        over the tasks before it (those review queries ask about)."""
        index, S = int(index), self.switch_every
        start = index // self.agent_every * self.agent_every if self.agent_every else 0
        start = max(start, index - self.num_tasks * S)
        phases = range(start // S, (index - 1) // S + 1) if index > start else ()
        return sorted({p % self.num_tasks for p in phases} - {self.task_at(index)})

    def _sequences(
        self,
        rng: np.random.Generator,
        rows: int,
        task_id: int,
        agent: int = 0,
        new=False,
        earlier: Sequence[int] = (),
    ) -> Batch:
        """Sequences of ``rows`` rows under task ``task_id`` of their agent ``agent``, the
        last ``review_queries`` queries on the tasks ``earlier`` (if any); with agents
        (``agent_every > 0``) the ``reset`` extra says whether the agent is ``new``."""
        p, q, K = self.num_pairs, self.num_queries, self.num_keys
        chains = np.stack([self._chain(r, agent) for r in range(rows)])  # (rows, tasks, K)
        f = chains[:, task_id]  # (rows, K)
        presented = sample_without_replacement(rng, K, p, rows=rows)
        queried = sample_without_replacement(rng, K, q, rows=rows)
        answers = np.take_along_axis(f, queried, axis=1)
        keys = self._key_tokens(task_id, queried)
        in_context = np.zeros((rows, self.seq_len), dtype=np.float32)
        in_context[:, 2 * p :: 2] = (queried[:, :, None] == presented[:, None, :]).any(axis=2)
        if self.review_queries and earlier:  # keys of earlier tasks, never presented here
            r = self.review_queries
            picks = sample_without_replacement(rng, len(earlier) * K, r, rows=rows)
            tasks, key = np.asarray(earlier)[picks // K], picks % K
            keys[:, q - r :] = self._key_tokens(tasks, key)
            answers[:, q - r :] = chains[np.arange(rows)[:, None], tasks, key]
            in_context[:, 2 * (p + q - r) :: 2] = 0.0
        inputs = np.zeros((rows, self.seq_len), dtype=np.int64)
        inputs[:, 0 : 2 * p : 2] = self._key_tokens(task_id, presented)
        inputs[:, 1 : 2 * p : 2] = np.take_along_axis(f, presented, axis=1)
        inputs[:, 2 * p :: 2] = keys
        inputs[:, 2 * p + 1 :: 2] = answers
        targets = np.zeros_like(inputs)
        targets[:, 2 * p :: 2] = answers
        mask = np.zeros(inputs.shape, dtype=np.float32)
        mask[:, 2 * p :: 2] = 1.0
        extras = {"task_id": np.full(rows, task_id, dtype=np.int32), "in_context": in_context}
        if self.agent_every:
            extras["reset"] = np.zeros(inputs.shape, np.float32)
            extras["reset"][:, 0] = float(new)
        return make_batch(inputs, targets, mask, **extras)

    def describe(self) -> str:
        vocab = 2 * (6 * self.num_tasks + 1) if self.disjoint_keys else 32
        small = dataclasses.replace(
            self, num_keys=6, num_pairs=3, num_queries=3, vocab_size=vocab, review_queries=0
        )
        example = render_example(small._sequences(np.random.default_rng(0), 1, 0))
        return (
            f"Continual KV stream: {self.num_tasks} tasks over {self.num_keys} keys, switching "
            f"every {self.switch_every} train batches, "
            + (
                "each task its own keys"
                if self.disjoint_keys
                else f"{self.remap_fraction:.0%} of keys remapped per switch"
            )
            + "; each batch row has its own mappings (so only the context "
            "and a fast state carried along the row can recall them)"
            + (f", a new agent every {self.agent_every} batches" if self.agent_every else "")
            + (
                f", the last {self.review_queries} training queries on earlier tasks"
                if self.review_queries
                else ""
            )
            + f"; each sequence = "
            f"{self.num_pairs} presented pairs k f(k), "
            f"then {self.num_queries} queries q f(q) scored at q (T={self.seq_len}).\n"
            f"Example (V={vocab}, 6 keys, 3 pairs, 3 queries):\n{example}"
        )
