"""Is a learning memory worth it? The companion against retrieval memories on held-out agents.

Every method sees the same held-out agents of a :class:`nested.data.CompanionTask` (another
seed than training's: the slow weights never saw them), the same events session by session,
and answers the same queries after each session:

* ``companion``: the trained model, slow weights frozen, one fast state per agent carried from
  session to session (what the service runs: :class:`nested.companion.engine.Companion`
  computes the same function);
* ``no_memory``: the same model answering every query from the learned initial state;
* ``knn``: a nearest-neighbour store of past (input, answer) pairs at **equal bytes** per agent
  (as many entries as the companion's fast state has bytes; the oldest evicted), the answer a
  top-k vote weighted by similarity; ``knn_recency``: and by recency; ``knn_unbounded``:
  every pair kept.
  Inputs are encoded by the same frozen encoder: the trained model's token embeddings,
  averaged over the input's tokens and normalised;
* ``oracle``: per agent, a multinomial logistic regression on the one-hot features of every
  event observed so far, fitted offline (the right hypothesis class, all the data at once;
  in the test-then-train regret refitted once a sequence).

Per session: accuracy on **novel** queries (inputs the agent never showed, answered by the rule
of that session), on the **rare facts** (shown once at the start), the rate of **stale**
answers after the drift (queries whose answer changed, answered the old way), and the
test-then-train **regret** (errors on the session's events, each predicted before it is
observed); then the sessions to **recover** after the drift (the first session whose novel
accuracy is back to 90% of the last one before it), bytes per agent and latencies of the
service at ``agents`` agents. Intervals are 95% bootstrap intervals over agents.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested.companion.engine import Companion, agent_bytes
from nested.companion.store import SQLiteStore
from nested.plasticity.deployment import Deployment
from nested.plasticity.regret import bootstrap_ci

METHODS = ("companion", "knn", "knn_recency", "knn_unbounded", "no_memory", "oracle")


@dataclasses.dataclass(frozen=True)
class Settings:
    agents: int = 64  # held-out agents (batch rows)
    agent_seed: int = 1000  # added to the task's seed
    queries: int = 32  # novel queries after each session
    k: int = 5  # neighbours voting, each with weight exp((similarity - best) / temperature)
    temperature: float = 0.1  # an exact match outvotes inputs sharing 2 of 3 features
    recency: float = 32.0  # knn_recency: also times exp(-age / recency), age in events
    latency_agents: int = 256
    latency_runs: int = 5


def _one_hot(task, inputs: np.ndarray) -> np.ndarray:
    out = np.zeros((*inputs.shape[:-1], task.num_features))
    np.put_along_axis(out, inputs, 1.0, axis=-1)
    return out


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


def fit_oracle(task, inputs: np.ndarray, answers: np.ndarray, steps: int = 300) -> np.ndarray:
    """Multinomial logistic regression ``(L, F + 1)`` on one-hot inputs, full-batch gradient
    descent with a small L2 penalty: the per-agent offline fit."""
    x = np.concatenate([_one_hot(task, inputs), np.ones((len(inputs), 1))], axis=1)
    y = np.eye(task.num_labels)[answers]
    w = np.zeros((task.num_labels, x.shape[1]))
    for _ in range(steps):
        logits = x @ w.T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        w -= 0.5 * ((p - y).T @ x / len(x) + 1e-3 * w)
    return w


class Model:
    """The trained model's two jitted uses here: a test-then-train session step (the
    deployment's) and answers to single-input queries from given fast states."""

    def __init__(self, trained, task, rows: int):
        self.program, self.params, self.task = trained.program, trained.state.params, task
        self.deployment = Deployment(self.program, self.params, rows)
        labels = np.arange(task.num_labels) + 1 + task.num_features
        program = self.program

        @jax.jit
        def answer(params, fast, queries):  # queries (rows, Q, k) tokens
            rows, Q, k = queries.shape
            flat = queries.reshape(rows * Q, k)
            repeat = lambda x: jnp.repeat(x, Q, axis=0)
            start = program.start_fast(params, rows * Q, jax.tree.map(repeat, fast))
            logits, _ = program.apply(params, flat, start)
            return jnp.argmax(logits[:, -1, labels], axis=-1).reshape(rows, Q)

        self._answer = answer
        table = nnx.to_pure_dict(self.params)["embed"]["embedding"]
        self.embedding = np.asarray(jax.device_get(table), np.float64)

    def answer(self, fast, queries: np.ndarray) -> np.ndarray:
        return np.asarray(self._answer(self.params, fast, jnp.asarray(queries, jnp.int32)))

    def encode(self, inputs: np.ndarray) -> np.ndarray:
        """The frozen encoder: mean token embedding of each input, unit norm."""
        vectors = self.embedding[1 + inputs].mean(axis=-2)
        return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def run(trained, settings: Settings = Settings(), progress: Callable[[], None] = lambda: None):
    """The study (module docstring) of the trained companion run ``trained``: a JSON-able dict
    ``{"settings", "bytes", "sessions": {method: {metric: [per session]}}, "summary",
    "latency"}``."""
    with tempfile.TemporaryDirectory() as folder:  # the companion's store, for its latency
        companion = Companion(trained, SQLiteStore(f"{folder}/latency.sqlite"))
        return _study(trained, companion, settings, progress)


def _study(trained, companion: Companion, settings: Settings, progress) -> dict[str, Any]:
    base = trained.experiment.task
    task = dataclasses.replace(base, seed=base.seed + settings.agent_seed)
    N, S, L = settings.agents, task.sessions, task.num_labels
    model = Model(trained, task, N)
    agents = [task.agent(r, 0) for r in range(N)]
    rng = np.random.default_rng(task.seed)
    shown: list[set] = [set() for _ in range(N)]
    capacity = agent_bytes(companion) // (4 * model.embedding.shape[1] + 4)
    knn = lambda capacity, recency: [
        Retrieval(capacity, settings.k, recency, settings.temperature) for _ in range(N)
    ]
    stores = {
        "knn": knn(capacity, None),
        "knn_recency": knn(capacity, settings.recency),
        "knn_unbounded": knn(None, None),
    }
    history = [([], []) for _ in range(N)]  # every observed (input, answer), for the oracle
    metrics = {m: {k: [] for k in ("novel", "facts", "stale", "regret")} for m in METHODS}
    fast = model.deployment.fresh()
    fresh = fast
    for s in range(S):
        # The session's events, test-then-train.
        errors = {m: np.zeros(N) for m in METHODS}
        for j in range(task.session_length):
            drawn = [task.sequence(a, s, rng, first=s == 0 and j == 0) for a in agents]
            inputs = np.stack([d[0] for d in drawn])  # (N, E, k)
            answers = np.stack([d[1] for d in drawn])  # (N, E)
            batch = task.events_batch(inputs, answers, reset=False)
            arrays = {"inputs": batch.inputs, "targets": batch.targets, "mask": batch.mask}
            _, parts = model.deployment.session(fresh, [arrays])
            errors["no_memory"] += parts[0]["count"] - parts[0]["correct"]
            fast, parts = model.deployment.session(fast, [arrays])
            errors["companion"] += parts[0]["count"] - parts[0]["correct"]
            keys = model.encode(inputs)
            for r in range(N):
                # The oracle is refitted once a sequence, on everything observed before it.
                if history[r][0]:
                    w = fit_oracle(task, np.stack(history[r][0]), np.array(history[r][1]))
                    x = np.concatenate([_one_hot(task, inputs[r]), np.ones((task.events, 1))], 1)
                    errors["oracle"][r] += np.sum(np.argmax(x @ w.T, axis=1) != answers[r])
                else:
                    errors["oracle"][r] += task.events
                for e in range(task.events):
                    for name, memory in stores.items():
                        guess = memory[r].predict(keys[r, e], L)
                        errors[name][r] += guess != answers[r, e]
                        memory[r].add(keys[r, e], answers[r, e])
                    history[r][0].append(inputs[r, e])
                    history[r][1].append(answers[r, e])
                    shown[r].add(tuple(inputs[r, e]))
            progress()
        # Queries after the session.
        novel = np.stack([_novel(task, rng, shown[r], settings.queries) for r in range(N)])
        rule = [task.rule_at(a, s) for a in agents]
        truth = np.stack([task.answers(rule[r], novel[r]) for r in range(N)])
        old = np.stack([task.answers(agents[r].rule, novel[r]) for r in range(N)])
        facts = np.stack([a.facts for a in agents])
        fact_truth = np.stack([a.fact_answers for a in agents])
        guesses = _answers(model, fast, fresh, stores, history, task, novel, facts)
        for method, (novel_guess, fact_guess) in guesses.items():
            row = metrics[method]
            row["novel"].append((novel_guess == truth).mean(axis=1))
            row["facts"].append((fact_guess == fact_truth).mean(axis=1))
            changed = truth != old
            stale = np.where(changed, novel_guess == old, False).sum(1) / np.maximum(
                changed.sum(1), 1
            )
            row["stale"].append(stale if s >= task.drift_session else np.zeros(N))
            row["regret"].append(errors[method])
        progress()
    return _report(task, settings, metrics, capacity, companion)


def _novel(task, rng, shown: set, count: int) -> np.ndarray:
    out = []
    while len(out) < count:
        (x,) = task.draw_inputs(rng, 1)
        if tuple(x) not in shown:
            out.append(x)
    return np.stack(out)


def _answers(model, fast, fresh, stores, history, task, novel, facts) -> dict[str, tuple]:
    """Each method's answers ``((N, Q), (N, R))`` to the novel queries and the rare facts."""
    L, N = task.num_labels, len(novel)
    both = np.concatenate([novel, facts], axis=1)
    tokens = 1 + both
    out = {}
    for name, state in (("companion", fast), ("no_memory", fresh)):
        answered = model.answer(state, tokens)
        out[name] = (answered[:, : novel.shape[1]], answered[:, novel.shape[1] :])
    keys = model.encode(both)
    for name, memory in stores.items():
        answered = np.array([[memory[r].predict(k, L) for k in keys[r]] for r in range(N)])
        out[name] = (answered[:, : novel.shape[1]], answered[:, novel.shape[1] :])
    answered = []
    for r in range(N):
        w = fit_oracle(task, np.stack(history[r][0]), np.array(history[r][1]))
        x = np.concatenate([_one_hot(task, both[r]), np.ones((both.shape[1], 1))], axis=1)
        answered.append(np.argmax(x @ w.T, axis=1))
    answered = np.stack(answered)
    out["oracle"] = (answered[:, : novel.shape[1]], answered[:, novel.shape[1] :])
    return out


def _report(task, settings, metrics, capacity, companion: Companion) -> dict[str, Any]:
    sessions, summary = {}, {}
    for method, rows in metrics.items():
        sessions[method] = {}
        for name, per_session in rows.items():
            values = np.stack(per_session, axis=1)  # (N, S)
            if name == "regret":
                values = np.cumsum(values, axis=1)
            estimate, low, high = bootstrap_ci(values)
            sessions[method][name] = {
                "mean": estimate.tolist(),
                "low": low.tolist(),
                "high": high.tolist(),
            }
        novel = np.stack(rows["novel"], axis=1)
        summary[method] = {"recover": _recovery(task, novel)}
    return {
        "settings": dataclasses.asdict(settings),
        "task": dataclasses.asdict(task),
        "bytes": {"companion": agent_bytes(companion), "knn_capacity": int(capacity)},
        "sessions": sessions,
        "summary": summary,
        "latency": latency(companion, task, settings),
    }


def _recovery(task, novel: np.ndarray) -> dict[str, Any]:
    """Sessions after the drift until the mean novel accuracy is back to 90% of the last
    session before it (None: not within the agent's sessions)."""
    d = task.drift_session
    if not 1 <= d < task.sessions:
        return {"sessions": None}
    before = novel[:, d - 1].mean()
    after = novel[:, d:].mean(axis=0)
    back = [i for i, value in enumerate(after) if value >= 0.9 * before]
    return {"sessions": back[0] + 1 if back else None, "before": float(before)}


def latency(companion: Companion, task, settings: Settings) -> dict[str, float]:
    """Median seconds of the service's observe (one sequence each) and recall (one query
    each) calls for ``latency_agents`` agents at once, after a compiling call."""
    n = settings.latency_agents
    rng = np.random.default_rng(0)
    agents = [task.agent(r, 0) for r in range(n)]
    requests = {}
    for r, a in enumerate(agents):
        inputs, answers = task.sequence(a, 0, rng)
        requests[f"agent-{r}"] = task.encode(inputs, answers).tolist()
    queries = {f"agent-{r}": [(1 + task.draw_inputs(rng, 1)[0]).tolist()] for r in range(n)}
    timed = {}
    for name, call, payload in (
        ("observe", companion.observe, requests),
        ("recall", companion.recall, queries),
    ):
        call(payload)
        seconds = []
        for _ in range(settings.latency_runs):
            start = time.perf_counter()
            call(payload)
            seconds.append(time.perf_counter() - start)
        timed[f"{name}_s"] = float(np.median(seconds))
    return {"agents": n, **timed}


def format_summary(result: dict[str, Any]) -> str:
    """Novel-query accuracy after each session per method, recovery, facts, regret, sizes."""
    lines = []
    for method, rows in result["sessions"].items():
        novel = " ".join(f"{100 * v:.0f}" for v in rows["novel"]["mean"])
        recover = result["summary"][method]["recover"].get("sessions")
        recovery = (
            "does not recover within the sessions"
            if recover is None
            else f"recovers in {recover} session(s)"
        )
        lines.append(
            f"{method:>14}: novel accuracy by session (%) {novel}; facts "
            f"{100 * rows['facts']['mean'][-1]:.0f}%; regret {rows['regret']['mean'][-1]:.1f} "
            f"errors; {recovery}"
        )
    size, latency = result["bytes"], result["latency"]
    lines.append(
        f"bytes per agent {size['companion']} (knn keeps {size['knn_capacity']} pairs); at "
        f"{latency['agents']} agents observe {1e3 * latency['observe_s']:.0f} ms, recall "
        f"{1e3 * latency['recall_s']:.0f} ms a call"
    )
    return "\n".join(lines)
