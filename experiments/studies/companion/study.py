"""Is a learning memory worth it? The companion against other memories on held-out agents.

Every method sees the same held-out agents of a :class:`nested.data.CompanionTask` (another
seed than training's: the slow weights never saw them), the same events session by session,
and answers the same queries after each session:

* ``companion``: the trained model, slow weights frozen, one fast state per agent carried from
  session to session (what the service runs: :class:`nested.companion.engine.Companion`
  computes the same function); its fast state's bytes are the **budget** B every equal-bytes
  baseline is held to;
* ``no_memory``: the same model answering every query from the learned initial state;
* ``knn``: a nearest-neighbour store of past (input, answer) pairs at **equal bytes** per agent
  (``B // (4 d + 4)`` pairs of a float32 key and an int32 answer; the oldest evicted), the
  answer a top-k vote weighted by similarity; ``knn_recency``: and by recency;
  ``knn_unbounded``: every pair kept. Inputs are encoded by the same frozen encoder: the
  trained model's token embeddings (d of them), averaged over the input's tokens and
  normalised (on a text task: the query sentence's tokens, a text-embedding retrieval);
* ``raw_overlap``: a store of the raw events at equal bytes (each event's k feature ids and
  its answer, one byte each while F, L <= 256: ``(B - 4) // (k + 1)`` events and a write
  counter, so it holds every event an agent shows), answering with the stored event sharing
  the most feature ids with the query, the most recent among ties (:class:`RawRetrieval`);
* ``logistic``: an online learner of the task's own hypothesis class, multinomial logistic
  regression on the one-hot features (on a text task: on the bag of tokens of the query
  sentence, :func:`~studies.companion.baselines.features`), one SGD step per event
  (:class:`OnlineLogistic`), its
  learning rate the best of ``Settings.lr_grid`` on **training** agents
  (:func:`tune_learning_rate`; the held-out agents never reach the tuner);
* ``votes``: per-feature vote counts, the answer the label of most summed counts
  (:class:`VoteCounter`);
* ``oracle``: per agent, a multinomial logistic regression on the one-hot features of every
  event observed so far, fitted offline (the right hypothesis class, all the data at once;
  in the test-then-train regret refitted once a sequence).

``logistic`` and ``votes`` are the whole of their hypothesis class in fewer bytes than B
(:func:`method_bytes`): more bytes would not change them.

Per session: accuracy on **novel** queries (inputs the agent never showed, answered by the rule
of that session), on the **rare facts** (shown once at the start), the rate of **stale**
answers after the drift (queries whose answer changed, answered the old way), and the
test-then-train **regret** (errors on the session's events, each predicted before it is
observed); then the sessions to **recover** after the drift (the first session whose novel
accuracy is back to 90% of the last one before it), bytes per agent and latencies of the
service at ``agents`` agents. Intervals are 95% bootstrap intervals over agents.

**Text.** A run of the text task (``configs/companion.py:text``) is studied the same way, its
events and queries sentences: the text rows are the companion against ``knn`` (retrieval by
the frozen model's own embeddings of the query sentence: no sentence-embedding model is
available offline) and against ``logistic`` on the sentence's bag of tokens
(:func:`format_summary`'s "text task" line). ``raw_overlap``, ``votes`` and ``oracle`` still
read the parsed feature ids: references, not text methods.

**Variants** (``Settings.variants``): the same trained model and baselines on held-out agents
whose rule differs in kind from training's (:data:`VARIANTS`: the task's ``features_per_input``
and ``rule_kind``, :mod:`nested.data.companion`): 2 or 4 features per input instead of 3, a
rule where one feature decides alone, answers that depend on feature pairs. Per variant: each
method's novel accuracy averaged over the sessions, the companion's advantage
``a_m = acc_companion - acc_m`` over each method (paired over agents), and the share of the
standard agents' advantage that survives, ``a_m(variant) / a_m(standard)``, each with a
bootstrap interval over agents (the variants' agents are the standard ones' rows, so the
ratio is resampled in pairs).
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
from nested.data import CompanionTask
from nested.data.batch import rng_for
from nested.data.companion import FAMILIES, Agent
from nested.plasticity.deployment import Deployment
from nested.plasticity.regret import bootstrap_ci
from studies.companion.baselines import (
    EQUAL_BYTES,
    OnlineLogistic,
    RawRetrieval,
    Retrieval,
    VoteCounter,
    fit_oracle,
    method_bytes,
    oracle_answers,
    raw_capacity,
    test_then_train,
    tune_learning_rate,
)

METHODS = (
    "companion",
    "knn",
    "knn_recency",
    "knn_unbounded",
    "raw_overlap",
    "logistic",
    "votes",
    "no_memory",
    "oracle",
)
# Held-out agents whose rule differs in kind from training's: the task's fields they change.
VARIANTS = {
    "standard": {},
    "k2": {"features_per_input": 2},
    "k4": {"features_per_input": 4},
    "one_feature": {"rule_kind": "one_feature"},
    "pairs": {"rule_kind": "pairs"},
}


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
    lr_grid: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0)  # logistic's, tuned on training
    tune_agents: int = 32  # training agents (rows of the training seed) the tuner sees
    variants: tuple[str, ...] = ("k2", "k4", "one_feature", "pairs")  # of VARIANTS


def held_out(base: CompanionTask, settings: Settings, variant: str = "standard"):
    """``(task, agents)``: the held-out agents of ``variant`` (:data:`VARIANTS`), rows
    ``0 .. agents - 1`` of the training task with ``agent_seed`` added to its seed, one family
    (no ``families``: the task's own k and rule, the variant's fields changed) and, where the
    training task pads its events, its ``width`` (or the variant's k if larger)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r}; use one of {tuple(VARIANTS)}")
    fields = dataclasses.asdict(base)
    fields.update(seed=base.seed + settings.agent_seed, families=(), **VARIANTS[variant])
    if base.families or base.input_width:  # padded events: the model's layout, or wider
        fields["input_width"] = max(base.width, fields["features_per_input"])
    task = CompanionTask(**fields)
    return task, [task.agent(r, 0) for r in range(settings.agents)]


def training_agents(base: CompanionTask, count: int) -> list[Agent]:
    """Agents of the training task itself (its seed): rows ``0 .. count - 1`` of its first
    agents, those of training batches ``0 .. sessions * session_length - 1``; of a task with
    ``families``, the agents those rows draw as its own one family (``features_per_input``,
    ``rule_kind``: the same draws, a family's agent being the one-family task's)."""
    return [one_family(base).agent(r, 0) for r in range(count)]


def one_family(task: CompanionTask) -> CompanionTask:
    """``task`` without ``families`` (its own k and rule), its events as wide as before."""
    if not task.families:
        return task
    return dataclasses.replace(task, families=(), input_width=task.width)


class Model:
    """The trained model's two jitted uses here: a test-then-train session step (the
    deployment's) and answers to single-input queries from given fast states."""

    def __init__(self, trained, task, rows: int):
        self.program, self.params, self.task = trained.program, trained.state.params, task
        self.deployment = Deployment(self.program, self.params, rows)
        labels = task.label_token(np.arange(task.num_labels))
        program = self.program

        @jax.jit
        def answer(params, fast, queries):  # queries (rows, Q, q) tokens
            rows, Q, q = queries.shape
            flat = queries.reshape(rows * Q, q)
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
        """The frozen encoder: the mean embedding of each input's query tokens (its feature
        tokens, padding left out; on a text task, the words of ``the <features> box is``),
        unit norm."""
        tokens = self.task.query_tokens(inputs)
        real = (tokens != 0) | self.task.text  # token 0 pads a short input (text: none)
        vectors = (self.embedding[tokens] * real[..., None]).sum(-2) / real.sum(-1, keepdims=True)
        return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def run(trained, settings: Settings = Settings(), progress: Callable[[], None] = lambda: None):
    """The study (module docstring) of the trained companion run ``trained``: a JSON-able dict
    ``{"settings", "task", "bytes", "sessions": {method: {metric: [per session]}}, "summary",
    "tuning", "variants": {variant: ...}, "latency"}``; ``progress`` is called once a sequence
    and once a session's queries, variant by variant."""
    with tempfile.TemporaryDirectory() as folder:  # the companion's store, for its latency
        companion = Companion(trained, SQLiteStore(f"{folder}/latency.sqlite"))
        return _study(trained, companion, settings, progress)


def _study(trained, companion: Companion, settings: Settings, progress) -> dict[str, Any]:
    base = trained.experiment.task
    for variant in settings.variants:  # a bad name fails before anything runs
        if variant == "standard" or variant not in VARIANTS:
            known = tuple(v for v in VARIANTS if v != "standard")
            raise ValueError(f"variants: {variant!r}; use some of {known}")
    budget = agent_bytes(companion)
    tuned = training_agents(base, settings.tune_agents)
    rng = rng_for(base.seed, "tune", 0)
    lr, tried = tune_learning_rate(one_family(base), tuned, settings.lr_grid, rng)
    model = Model(trained, base, settings.agents)
    task, agents = held_out(base, settings)
    metrics = _evaluate(model, task, agents, settings, budget, lr, progress)
    result = _report(task, settings, metrics, budget, model, companion)
    result["tuning"] = {"lr": lr, "errors": tried, "agents": settings.tune_agents}
    variants = {"standard": _variant_row(task, metrics, budget, model)}
    for variant in settings.variants:
        other, others = held_out(base, settings, variant)
        found = _evaluate(model, other, others, settings, budget, lr, progress)
        variants[variant] = _variant_row(other, found, budget, model, standard=metrics)
    trained = {FAMILIES[f] for f in base.families} or {(base.features_per_input, base.rule_kind)}
    for row in variants.values():  # is the variant's family among the training agents'?
        row["trained"] = (row["task"]["features_per_input"], row["task"]["rule_kind"]) in trained
    result["variants"] = variants
    return result


def _evaluate(model, task, agents, settings, budget, lr, progress) -> dict[str, dict]:
    """Every method on ``agents`` of ``task``: ``{method: {metric: [(N,) per session]}}``."""
    N, S, L = len(agents), task.sessions, task.num_labels
    rng = np.random.default_rng(task.seed)
    shown: list[set] = [set() for _ in range(N)]
    capacity = budget // (4 * model.embedding.shape[1] + 4)
    knn = lambda capacity, recency: [
        Retrieval(capacity, settings.k, recency, settings.temperature) for _ in range(N)
    ]
    stores = {
        "knn": knn(capacity, None),
        "knn_recency": knn(capacity, settings.recency),
        "knn_unbounded": knn(None, None),
    }
    learners = {
        "raw_overlap": RawRetrieval(task, N, raw_capacity(task, budget)),
        "logistic": OnlineLogistic(task, N, lr),
        "votes": VoteCounter(task, N),
    }
    history: list[tuple] = []  # every observed (inputs (N, E, k), answers (N, E)), the oracle's
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
            # The oracle is refitted once a sequence, on everything observed before it.
            if history:
                w = fit_oracle(task, *_seen(history))
                errors["oracle"] += np.sum(oracle_answers(task, w, inputs) != answers, axis=1)
            else:
                errors["oracle"] += task.events
            keys = model.encode(inputs)
            for r in range(N):
                for e in range(task.events):
                    for name, memory in stores.items():
                        guess = memory[r].predict(keys[r, e], L)
                        errors[name][r] += guess != answers[r, e]
                        memory[r].add(keys[r, e], answers[r, e])
                    shown[r].add(tuple(inputs[r, e]))
            for name, learner in learners.items():
                errors[name] += test_then_train(learner, inputs, answers)
            history.append((inputs, answers))
            progress()
        # Queries after the session.
        novel = np.stack([_novel(task, rng, shown[r], settings.queries) for r in range(N)])
        rule = [task.rule_at(a, s) for a in agents]
        truth = np.stack([task.answers(rule[r], novel[r]) for r in range(N)])
        old = np.stack([task.answers(agents[r].rule, novel[r]) for r in range(N)])
        facts = np.stack([a.facts for a in agents])
        fact_truth = np.stack([a.fact_answers for a in agents])
        queries = (model, fast, fresh, stores, learners, history, task, novel, facts)
        for method, (novel_guess, fact_guess) in _answers(*queries).items():
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
    return metrics


def _seen(history: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([h[0] for h in history], 1), np.concatenate([h[1] for h in history], 1)


def _novel(task, rng, shown: set, count: int) -> np.ndarray:
    out = []
    while len(out) < count:
        (x,) = task.draw_inputs(rng, 1)
        if tuple(x) not in shown:
            out.append(x)
    return np.stack(out)


def _answers(model, fast, fresh, stores, learners, history, task, novel, facts) -> dict:
    """Each method's answers ``((N, Q), (N, R))`` to the novel queries and the rare facts."""
    L, N = task.num_labels, len(novel)
    both = np.concatenate([novel, facts], axis=1)
    tokens = task.query_tokens(both)
    answered = {}
    for name, state in (("companion", fast), ("no_memory", fresh)):
        answered[name] = model.answer(state, tokens)
    keys = model.encode(both)
    for name, memory in stores.items():
        answered[name] = np.array([[memory[r].predict(k, L) for k in keys[r]] for r in range(N)])
    for name, learner in learners.items():
        answered[name] = learner.predict(both)
    answered["oracle"] = oracle_answers(task, fit_oracle(task, *_seen(history)), both)
    Q = novel.shape[1]
    return {name: (a[:, :Q], a[:, Q:]) for name, a in answered.items()}


def _interval(values: np.ndarray) -> dict[str, float]:
    """Mean and 95% bootstrap interval over agents (axis 0) of ``values``."""
    estimate, low, high = bootstrap_ci(values)
    return {"mean": float(estimate), "low": float(low), "high": float(high)}


def _survival(gained: np.ndarray, before: np.ndarray, resamples: int = 2000) -> dict | None:
    """``mean(gained) / mean(before)`` over agents (the advantage in a variant over the
    standard agents' one, rows paired) and its 95% percentile bootstrap interval over the
    resamples of agents (the same rows for both) where ``mean(before) > 0``; ``undefined``:
    the share of resamples left out. None where ``mean(before) <= 0`` (nothing survives of
    no advantage) or no resample has it positive."""
    if before.mean() <= 0:
        return None
    idx = np.random.default_rng(0).integers(0, len(before), size=(resamples, len(before)))
    top, bottom = gained[idx].mean(axis=1), before[idx].mean(axis=1)
    kept = bottom > 0
    if not kept.any():
        return None
    low, high = np.percentile(top[kept] / bottom[kept], [2.5, 97.5])
    return {
        "mean": float(gained.mean() / before.mean()),
        "low": float(low),
        "high": float(high),
        "undefined": float(1 - kept.mean()),
    }


def _variant_row(task, metrics, budget, model, standard=None) -> dict[str, Any]:
    """One variant's figures: each method's novel accuracy averaged over the sessions and
    its total regret; the companion's advantage ``a_m`` over each method (per agent, then
    bootstrapped); ``best``: the equal-bytes baseline of the highest accuracy;
    ``regret_saved[m]``: m's regret minus the companion's (paired, in errors), ``regret_best``
    the equal-bytes baseline of the least regret; and, given
    the ``standard`` agents' metrics, ``survives[m] = mean a_m / mean a_m(standard)``
    (resampled in pairs of rows; None where the standard advantage is not positive)."""
    accuracy = {m: np.stack(metrics[m]["novel"], axis=1).mean(axis=1) for m in METHODS}
    regret = {m: np.sum(metrics[m]["regret"], axis=0) for m in METHODS}
    out = {
        "task": {
            "features_per_input": task.features_per_input,
            "rule_kind": task.rule_kind,
        },
        "bytes": method_bytes(task, budget, model.embedding.shape[1]),
        "novel": {m: _interval(a) for m, a in accuracy.items()},
        "regret": {m: _interval(r) for m, r in regret.items()},
        "advantage": {
            m: _interval(accuracy["companion"] - a) for m, a in accuracy.items() if m != "companion"
        },
        "best": max(EQUAL_BYTES, key=lambda m: accuracy[m].mean()),
        "regret_best": min(EQUAL_BYTES, key=lambda m: regret[m].mean()),
        "regret_saved": {  # errors the companion makes fewer than m (positive: it wins)
            m: _interval(r - regret["companion"]) for m, r in regret.items() if m != "companion"
        },
    }
    if standard is not None:
        base = {m: np.stack(standard[m]["novel"], axis=1).mean(axis=1) for m in METHODS}
        out["survives"] = {}
        for m in METHODS[1:]:
            gained, before = accuracy["companion"] - accuracy[m], base["companion"] - base[m]
            out["survives"][m] = _survival(gained, before)
    return out


def _report(task, settings, metrics, budget, model, companion: Companion) -> dict[str, Any]:
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
    dim = model.embedding.shape[1]
    return {
        "settings": dataclasses.asdict(settings),
        "task": dataclasses.asdict(task),
        "bytes": {
            "companion": budget,
            "knn_capacity": int(budget // (4 * dim + 4)),
            "raw_capacity": int(raw_capacity(task, budget)),
            "methods": method_bytes(task, budget, dim),
        },
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
    queries = {
        f"agent-{r}": [task.query_tokens(task.draw_inputs(rng, 1)[0]).tolist()] for r in range(n)
    }
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


def _pm(interval: dict[str, float] | None, unit: str = "") -> str:
    """``mean [low, high]`` of an interval in percent (points), ``unit`` after; ``—`` for
    None."""
    if interval is None:
        return "—"
    m, lo, hi = (100 * interval[k] for k in ("mean", "low", "high"))
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]{unit}"


def format_variant(name: str, row: dict[str, Any]) -> str:
    """One variant's line: each method's novel accuracy over the sessions (%), the
    companion's advantage over knn and over the best equal-bytes baseline (points), the
    regret it saves against the baseline of least regret (errors), the share of the
    advantage that survives from the standard agents (%), and whether training saw the
    variant's family."""
    accuracy = " ".join(f"{m} {100 * v['mean']:.1f}" for m, v in row["novel"].items())
    best = row["best"]
    line = (
        f"{name:>11} (k={row['task']['features_per_input']}, {row['task']['rule_kind']}): "
        f"novel accuracy over sessions (%) {accuracy}; companion - knn "
        f"{_pm(row['advantage']['knn'])}, - {best} (best at equal bytes) "
        f"{_pm(row['advantage'][best])}"
    )
    if "regret_saved" in row:
        saved = row["regret_saved"][row["regret_best"]]
        line += (
            f"; regret {row['regret_best']} - companion {saved['mean']:+.1f} "
            f"[{saved['low']:+.1f}, {saved['high']:+.1f}] errors"
        )
    if "survives" in row:
        line += (
            f"; survives vs knn {_pm(row['survives']['knn'], '%')}, vs {best} "
            f"{_pm(row['survives'][best], '%')}"
        )
    if "trained" in row:
        line += "; a training family" if row["trained"] else "; held out of training"
    return line


def format_summary(result: dict[str, Any]) -> str:
    """Novel-query accuracy after each session per method, recovery, facts, regret, sizes;
    then the variants, one line each."""
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
    each = ", ".join(f"{m} {b}" for m, b in size.get("methods", {}).items())
    lines.append(
        f"bytes per agent {size['companion']} (knn keeps {size['knn_capacity']} pairs"
        + (f"; raw_overlap {size['raw_capacity']} events" if "raw_capacity" in size else "")
        + f"){'; each: ' + each if each else ''}; at {latency['agents']} agents observe "
        f"{1e3 * latency['observe_s']:.0f} ms, recall {1e3 * latency['recall_s']:.0f} ms a call"
    )
    if "tuning" in result:
        lines.append(
            f"logistic lr {result['tuning']['lr']:g} (tuned on {result['tuning']['agents']} "
            f"training agents; mean errors {result['tuning']['errors']})"
        )
    standard = result.get("variants", {}).get("standard")
    if result["task"].get("text") and standard is not None:
        gap = standard["advantage"]
        lines.append(
            f"text task: companion - knn (retrieval by the frozen model's embeddings of the "
            f"sentence) {_pm(gap['knn'])}, - logistic (bag of tokens) {_pm(gap['logistic'])} "
            f"points of novel accuracy over sessions"
        )
    for name, row in result.get("variants", {}).items():
        lines.append(format_variant(name, row))
    return "\n".join(lines)
