"""The companion study's baselines: what a learning memory is held against, per agent.

Retrieval memories of (encoded input, answer) pairs (:class:`Retrieval`: ``knn``,
``knn_recency``, ``knn_unbounded``) and of raw events (:class:`RawRetrieval`:
``raw_overlap``), online learners of the task's own hypothesis class (:class:`OnlineLogistic`,
:class:`VoteCounter`), the offline per-agent oracle (:func:`fit_oracle`), their bytes per agent
(:func:`method_bytes`), and the test-then-train protocol they are scored and tuned with
(:func:`test_then_train`, :func:`tune_learning_rate`, on training agents only). The study
that runs them: :mod:`studies.companion.study`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nested.data.companion import Agent

EQUAL_BYTES = ("knn", "knn_recency", "raw_overlap", "logistic", "votes")  # held to B bytes


def one_hot(task, inputs: np.ndarray) -> np.ndarray:
    out = np.zeros((*inputs.shape[:-1], task.num_features))
    np.put_along_axis(out, inputs, 1.0, axis=-1)
    return out


def features(task, inputs: np.ndarray) -> np.ndarray:
    """What :class:`OnlineLogistic` reads of ``inputs`` ``(..., k)``: the one-hot features
    ``(..., F)``; on a text task the bag of tokens of the query sentence ``(..., V)`` (token
    counts of ``the <features> box is``: the features' words and the template's, which every
    sentence holds)."""
    if not task.text:
        return one_hot(task, inputs)
    tokens = task.query_tokens(inputs)
    return (tokens[..., None] == np.arange(task.vocab_size)).sum(axis=-2).astype(np.float64)


class Retrieval:
    """A nearest-neighbour memory of (encoded input, answer) pairs of one agent."""

    def __init__(
        self, capacity: int | None, k: int, recency: float | None, temperature: float = 0.1
    ):
        self.capacity, self.k, self.recency = capacity, k, recency
        self.temperature = temperature
        self.keys: list[np.ndarray] = []
        self.answers: list[int] = []

    def predict(self, key: np.ndarray, labels: int) -> int:
        if not self.keys:
            return 0
        keys = np.stack(self.keys)
        similarity = keys @ key
        nearest = np.argsort(-similarity)[: self.k]
        weights = np.exp((similarity[nearest] - similarity[nearest[0]]) / self.temperature)
        if self.recency is not None:
            age = len(self.keys) - 1 - nearest
            weights = weights * np.exp(-age / self.recency)
        votes = np.zeros(labels)
        np.add.at(votes, np.asarray(self.answers)[nearest], weights)
        return int(np.argmax(votes))

    def add(self, key: np.ndarray, answer: int) -> None:
        self.keys.append(key)
        self.answers.append(int(answer))
        if self.capacity is not None and len(self.keys) > self.capacity:
            self.keys.pop(0)
            self.answers.pop(0)


def _ids_dtype(task) -> np.dtype:
    """The smallest unsigned integer holding every feature id and label."""
    return np.min_scalar_type(max(task.num_features, task.num_labels) - 1)


def raw_capacity(task, budget: int) -> int:
    """Events a :class:`RawRetrieval` keeps in ``budget`` bytes: ``(budget - 4) // ((k + 1)
    s)``, ``s`` the bytes of an id (:func:`_ids_dtype`), 4 the write counter's."""
    return (budget - 4) // ((task.features_per_input + 1) * _ids_dtype(task).itemsize)


class RawRetrieval:
    """Stores of raw events for ``agents`` agents at once: each event's k feature ids and its
    answer, the oldest overwritten past ``capacity`` (a ring; one write counter).

    ``predict(x)`` is the answer of the stored event ``i`` maximising ``(|x ∩ x_i|, t_i)``: the
    most shared feature ids, then the latest write time ``t_i`` (ties broken by recency);
    label 0 when nothing is stored.
    """

    def __init__(self, task, agents: int, capacity: int):
        dtype = _ids_dtype(task)
        self.task, self.capacity, self.count = task, capacity, 0
        self.inputs = np.zeros((agents, capacity, task.features_per_input), dtype)
        self.answers = np.zeros((agents, capacity), dtype)

    @property
    def nbytes(self) -> int:
        """Bytes per agent: the ids and answers, and a 4-byte write counter."""
        return (self.inputs[0].nbytes + self.answers[0].nbytes) + 4

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """Answers ``(agents, ...)`` to ``inputs`` ``(agents, ..., k)``."""
        filled = min(self.count, self.capacity)
        if filled == 0:
            return np.zeros(inputs.shape[:-1], np.int64)
        flat = inputs.reshape(len(inputs), -1, inputs.shape[-1])
        stored = one_hot(self.task, self.inputs[:, :filled].astype(np.int64))  # (N, M, F)
        overlap = one_hot(self.task, flat) @ np.swapaxes(stored, 1, 2)  # (N, Q, M)
        order = (np.arange(filled) - self.count) % self.capacity  # oldest 0 .. newest
        best = np.argmax(overlap * self.capacity + order, axis=-1)  # (N, Q)
        answers = np.take_along_axis(self.answers[:, :filled], best, axis=1)
        return answers.astype(np.int64).reshape(inputs.shape[:-1])

    def observe(self, inputs: np.ndarray, answers: np.ndarray) -> None:
        """One event per agent: ``inputs`` ``(agents, k)``, ``answers`` ``(agents,)``."""
        slot = self.count % self.capacity
        self.inputs[:, slot], self.answers[:, slot] = inputs, answers
        self.count += 1


class OnlineLogistic:
    """Multinomial logistic regression on one-hot features (a text task: bag of tokens,
    :func:`features`) for ``agents`` agents at once, trained online: one SGD step on each
    event's cross-entropy.

    ``z = [onehot(x); 1]`` (F + 1; text: V + 1), ``p = softmax(W z)``, the answer
    ``argmax_c (W z)_c`` (the first label among ties, so label 0 from ``W = 0``), and after
    each event ``(x, y)`` ``W <- W - lr (p - e_y) z^T``. ``W`` is ``(L, F + 1)`` float32 per
    agent.
    """

    def __init__(self, task, agents: int, lr: float):
        self.task, self.lr = task, lr
        width = task.vocab_size if task.text else task.num_features
        self.w = np.zeros((agents, task.num_labels, width + 1), np.float32)

    @property
    def nbytes(self) -> int:
        return self.w[0].nbytes

    def _features(self, inputs: np.ndarray) -> np.ndarray:
        z = features(self.task, inputs)
        return np.concatenate([z, np.ones((*inputs.shape[:-1], 1))], axis=-1).astype(np.float32)

    def logits(self, inputs: np.ndarray) -> np.ndarray:
        """``(agents, ..., L)`` for ``inputs`` ``(agents, ..., k)``."""
        z = self._features(inputs)
        flat = z.reshape(len(z), -1, z.shape[-1])
        return (flat @ np.swapaxes(self.w, 1, 2)).reshape(*z.shape[:-1], -1)

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(inputs), axis=-1)

    def observe(self, inputs: np.ndarray, answers: np.ndarray) -> None:
        """One SGD step per agent on ``(inputs (agents, k), answers (agents,))``."""
        z = self._features(inputs)  # (N, F + 1)
        logits = np.einsum("nlf,nf->nl", self.w, z)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        error = p - np.eye(self.task.num_labels, dtype=np.float32)[answers]
        self.w -= (self.lr * error[:, :, None] * z[:, None, :]).astype(np.float32)


class VoteCounter:
    """Per-feature vote counts for ``agents`` agents at once: ``n[c, f]`` events with answer
    ``c`` whose input held feature ``f``; the answer ``argmax_c sum_{f in x} n[c, f]`` (the
    first label among ties). Counts are the smallest unsigned integers that hold an agent's
    lifetime of events (``sessions * session_length * events``)."""

    def __init__(self, task, agents: int):
        lifetime = task.sessions * task.session_length * task.events
        dtype = np.min_scalar_type(lifetime)
        self.counts = np.zeros((agents, task.num_labels, task.num_features), dtype)

    @property
    def nbytes(self) -> int:
        return self.counts[0].nbytes

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """Answers ``(agents, ...)`` to ``inputs`` ``(agents, ..., k)``."""
        flat = inputs.reshape(len(inputs), -1, inputs.shape[-1])
        rows = np.arange(len(inputs))[:, None, None]
        summed = self.counts.astype(np.int64)[rows, :, flat].sum(axis=2)  # (N, Q, L)
        return np.argmax(summed, axis=-1).reshape(inputs.shape[:-1])

    def observe(self, inputs: np.ndarray, answers: np.ndarray) -> None:
        rows = np.arange(len(inputs))[:, None]
        np.add.at(self.counts, (rows, answers[:, None], inputs), 1)


def method_bytes(task, budget: int, dim: int) -> dict[str, int]:
    """Bytes per agent of each method's memory for an agent's whole life, ``budget`` the
    companion's fast state: the equal-bytes ones (:data:`EQUAL_BYTES`) at most ``budget``,
    the retrieval stores within one entry of it; ``knn_unbounded`` and ``oracle`` (which
    refits on the raw history) what they hold at the end; ``no_memory`` 0."""
    lifetime = task.sessions * task.session_length * task.events
    entry = 4 * dim + 4
    ids = (task.features_per_input + 1) * _ids_dtype(task).itemsize
    return {
        "companion": budget,
        "knn": (budget // entry) * entry,
        "knn_recency": (budget // entry) * entry,
        "knn_unbounded": lifetime * entry,
        "raw_overlap": RawRetrieval(task, 1, raw_capacity(task, budget)).nbytes,
        "logistic": OnlineLogistic(task, 1, 0.0).nbytes,
        "votes": VoteCounter(task, 1).nbytes,
        "no_memory": 0,
        "oracle": lifetime * ids,
    }


def lifetime_stream(task, agents: Sequence[Agent], rng: np.random.Generator) -> list:
    """The agents' sequences in order, every session's: ``[(inputs (N, E, k), answers (N,
    E))]``, the first holding the rare facts."""
    stream = []
    for s in range(task.sessions):
        for j in range(task.session_length):
            drawn = [task.sequence(a, s, rng, first=s == 0 and j == 0) for a in agents]
            stream.append((np.stack([d[0] for d in drawn]), np.stack([d[1] for d in drawn])))
    return stream


def test_then_train(learner, inputs: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """Errors ``(N,)`` of ``learner`` on a sequence ``(N, E, k)``, each event predicted, then
    observed."""
    errors = np.zeros(len(inputs))
    for e in range(inputs.shape[1]):
        errors += learner.predict(inputs[:, e]) != answers[:, e]
        learner.observe(inputs[:, e], answers[:, e])
    return errors


def tune_learning_rate(
    task, agents: Sequence[Agent], grid: Sequence[float], rng: np.random.Generator
) -> tuple[float, dict[str, float]]:
    """The learning rate of ``grid`` whose :class:`OnlineLogistic` makes the fewest
    test-then-train errors over the whole lives of ``agents`` (the same stream for every
    rate; the first of the grid among ties), and each rate's mean errors per agent. The study
    calls it with training agents only (:func:`training_agents`)."""
    stream = lifetime_stream(task, agents, rng)
    errors = {}
    for lr in grid:
        learner = OnlineLogistic(task, len(agents), lr)
        errors[lr] = float(np.mean(sum(test_then_train(learner, x, y) for x, y in stream)))
    best = min(grid, key=lambda lr: errors[lr])
    return float(best), {str(lr): e for lr, e in errors.items()}


def fit_oracle(task, inputs: np.ndarray, answers: np.ndarray, steps: int = 300) -> np.ndarray:
    """Multinomial logistic regression ``(..., L, F + 1)`` on one-hot inputs ``(..., n, k)``
    (answers ``(..., n)``; leading axes: agents fitted at once), full-batch gradient descent
    with a small L2 penalty: ``W <- W - 0.5 ((P - Y)^T Z / n + 1e-3 W)``, the per-agent
    offline fit."""
    z = one_hot(task, inputs)
    x = np.concatenate([z, np.ones((*inputs.shape[:-1], 1))], axis=-1)
    y = np.eye(task.num_labels)[answers]
    w = np.zeros((*inputs.shape[:-2], task.num_labels, x.shape[-1]))
    for _ in range(steps):
        logits = x @ np.swapaxes(w, -1, -2)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        w -= 0.5 * (np.swapaxes(p - y, -1, -2) @ x / x.shape[-2] + 1e-3 * w)
    return w


def oracle_answers(task, w: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Answers ``(N, Q)`` of fits ``w`` ``(N, L, F + 1)`` to ``inputs`` ``(N, Q, k)``."""
    x = np.concatenate([one_hot(task, inputs), np.ones((*inputs.shape[:-1], 1))], axis=-1)
    return np.argmax(x @ np.swapaxes(w, -1, -2), axis=-1)
