"""The Agent Companion task: agents with private rules, observed over sessions.

Every agent has a private rule: each feature votes for a label of its own with a weight of
its own, and an input's answer is the label with the most weight,
``answer(x) = argmax_c sum_{f in x} W[c, f]``, ``W[c, f] = w_f`` if feature ``f`` votes for
``c`` else 0 (``w_f`` uniform in [0.5, 1.5], drawn per agent with the votes): a linear map,
learnt from a few events per feature, that answers inputs never shown. An *event* is an input
``x`` (``features_per_input`` distinct feature tokens) and its answer; a sequence is
``events`` events, a session ``session_length`` sequences, an agent lives ``sessions``
sessions. Token ids: 0 is unused, feature ``f`` is token ``1 + f``, label ``c`` token
``1 + num_features + c``; an event is ``x_1 .. x_k answer`` and is scored at ``x_k`` (predict
the answer, then see it: test-then-train). Inputs are drawn uniformly among the
``C(num_features, k)`` combinations, so later inputs are almost always new to the agent:
answering them takes the rule, not a lookup of what was shown.

Two departures from the rule, as a real agent's experience has them:

* **drift**: from session ``drift_session`` on, ``drift_fraction`` of the features vote for
  another label, so the answers of inputs holding those features may change (stale answers
  are what a memory that does not update gives);
* **rare facts**: ``rare_facts`` inputs whose answer breaks the rule (a label the rule does not
  give them), shown once each at the start of the agent's first sequence (exact facts, where
  a lookup of what was shown should win).

Training batch ``index``: each row is an agent; every row gets a new agent every
``sessions * session_length`` batches, the ``reset`` extra marking its first batch (the fast
state restarts from the learned initial state there: :meth:`nested.Program.train_step`), so
the slow weights learn how to learn an agent, never the agents. Row r's agent ``a`` is drawn
from (seed, r, a) alone. Eval split ``new_agent``: a held-out agent's first sequence (its
``reset`` set). Held-out agents for a study are this task with another ``seed``;
:meth:`agent` gives one agent's rule, facts and events for the companion study
(``experiments/studies/companion``) and its baselines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from nested.data.batch import Batch, check_request, field_error, make_batch, render_example, rng_for


@dataclasses.dataclass(frozen=True)
class Agent:
    """One agent: ``rule`` ``(num_labels, num_features)`` before the drift and ``drifted``
    after it; ``facts`` ``(rare_facts, k)`` inputs (feature ids) and ``fact_answers``
    ``(rare_facts,)`` labels that break the rule."""

    rule: np.ndarray
    drifted: np.ndarray
    facts: np.ndarray
    fact_answers: np.ndarray


@dataclasses.dataclass(frozen=True)
class CompanionTask:
    """Agents with private linear rules over feature tokens; see the module docstring.

    Fields:
      num_features: F, feature tokens ``1..F``.
      features_per_input: k, distinct features in an input.
      num_labels: L, label tokens ``F+1 .. F+L``.
      events: events per sequence (T = events * (k + 1)).
      session_length: sequences per session.
      sessions: sessions an agent lives (training: batches per agent = sessions * length).
      drift_session: first session under the drifted rule (``sessions`` or more: no drift).
      drift_fraction: share of the features that vote for another label after the drift.
      rare_facts: inputs with a rule-breaking answer, shown at the agent's start.
      seed: base seed; agents and batches depend on (seed, row, agent) and (seed, split, i).
    """

    num_features: int = 32
    features_per_input: int = 3
    num_labels: int = 8
    events: int = 16
    session_length: int = 2
    sessions: int = 8
    drift_session: int = 4
    drift_fraction: float = 0.5
    rare_facts: int = 2
    seed: int = 0

    name: ClassVar[str] = "companion"
    eval_splits: ClassVar[tuple[str, ...]] = ("new_agent",)

    def __post_init__(self):
        for field, low in [
            ("num_features", 2),
            ("features_per_input", 1),
            ("num_labels", 2),
            ("events", 1),
            ("session_length", 1),
            ("sessions", 1),
            ("drift_session", 0),
            ("rare_facts", 0),
            ("seed", 0),
        ]:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise field_error(self.name, field, value, f"use an int >= {low}")
        if self.features_per_input > self.num_features:
            raise field_error(
                self.name, "features_per_input", self.features_per_input, "use <= num_features"
            )
        if self.rare_facts > self.events:
            raise field_error(self.name, "rare_facts", self.rare_facts, "use <= events")
        if not 0.0 <= self.drift_fraction <= 1.0:
            raise field_error(self.name, "drift_fraction", self.drift_fraction, "use 0 <= f <= 1")

    @property
    def vocab_size(self) -> int:
        """1 + F + L: token 0 is unused."""
        return 1 + self.num_features + self.num_labels

    @property
    def seq_len(self) -> int:
        return self.events * (self.features_per_input + 1)

    @property
    def agent_batches(self) -> int:
        """Training batches per agent: ``sessions * session_length``."""
        return self.sessions * self.session_length

    def label_token(self, label):
        return 1 + self.num_features + np.asarray(label)

    def answers(self, rule: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """Labels ``(...,)`` of ``inputs`` ``(..., k)`` (feature ids) under ``rule``."""
        return np.argmax(rule[:, inputs].sum(axis=-1), axis=0)

    def agent(self, row: int, index: int = 0) -> Agent:
        """Agent ``index`` of batch row ``row``: drawn from (seed, row, index) alone, once."""
        return self._agents(int(row), int(index))

    @functools.cache  # noqa: B019 - frozen dataclass: the cache lives as long as the task
    def _agents(self, row: int, index: int) -> Agent:
        rng = rng_for(self.seed, f"agent/{index}", row)
        F, L, k = self.num_features, self.num_labels, self.features_per_input
        votes, weights = rng.integers(0, L, F), rng.uniform(0.5, 1.5, F)
        moved = rng.permutation(F)[: round(self.drift_fraction * F)]
        changed = votes.copy()
        changed[moved] = (votes[moved] + 1 + rng.integers(0, L - 1, moved.size)) % L
        rule, drifted = np.zeros((L, F)), np.zeros((L, F))
        rule[votes, np.arange(F)] = weights
        drifted[changed, np.arange(F)] = weights
        drawn = [np.sort(rng.choice(F, k, replace=False)) for _ in range(self.rare_facts)]
        facts = np.array(drawn, dtype=np.int64).reshape(self.rare_facts, k)  # rare_facts may be 0
        by_rule = self.answers(rule, facts)
        fact_answers = (by_rule + 1 + rng.integers(0, L - 1, size=by_rule.shape)) % L
        return Agent(rule, drifted, facts, fact_answers)

    def rule_at(self, agent: Agent, session: int) -> np.ndarray:
        return agent.drifted if session >= self.drift_session else agent.rule

    def draw_inputs(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``(count, k)`` sorted distinct feature ids per input."""
        keys = rng.random((count, self.num_features))
        return np.sort(np.argsort(keys, axis=1)[:, : self.features_per_input], axis=1)

    def encode(self, inputs: np.ndarray, answers: np.ndarray) -> np.ndarray:
        """Tokens ``(..., E * (k + 1))`` of events: each input's feature tokens, then its
        answer's label token."""
        tokens = np.concatenate([1 + inputs, self.label_token(answers)[..., None]], axis=-1)
        return tokens.reshape(*tokens.shape[:-2], -1)

    def sequence(
        self, agent: Agent, session: int, rng: np.random.Generator, *, first: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """One sequence of ``agent`` in ``session``: ``(inputs (E, k), answers (E,))``; the
        agent's ``first`` sequence starts with its rare facts."""
        inputs = self.draw_inputs(rng, self.events)
        answers = self.answers(self.rule_at(agent, session), inputs)
        if first and self.rare_facts:
            inputs[: self.rare_facts] = agent.facts
            answers[: self.rare_facts] = agent.fact_answers
        return inputs, answers

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split``: training rows are agents (module docstring);
        ``new_agent`` is held-out agents' first sequences."""
        check_request(self, index, batch_size, split)
        rng = rng_for(self.seed, split, int(index))
        if split == "train":
            which, step = divmod(int(index), self.agent_batches)
            agents = [self.agent(r, which) for r in range(batch_size)]
            session = step // self.session_length
        else:  # held-out agents: their own stream of agent indices, far from training's
            agents = [self.agent(r, -1 - int(index)) for r in range(batch_size)]
            step = session = 0
        drawn = [self.sequence(a, session, rng, first=step == 0) for a in agents]
        inputs = np.stack([d[0] for d in drawn])
        answers = np.stack([d[1] for d in drawn])
        return self.events_batch(inputs, answers, reset=step == 0)

    def events_batch(self, inputs: np.ndarray, answers: np.ndarray, *, reset: bool) -> Batch:
        """Tokens of ``(B, E, k)`` inputs and ``(B, E)`` answers; the answer of each event is
        the target at its last feature token."""
        tokens = self.encode(inputs, answers)
        k = self.features_per_input
        targets = np.zeros_like(tokens)
        targets[:, :-1] = tokens[:, 1:]
        mask = np.zeros(tokens.shape, np.float32)
        mask[:, k - 1 :: k + 1] = 1.0
        flag = np.zeros(tokens.shape, np.float32)
        flag[:, 0] = float(reset)
        return make_batch(tokens, targets, mask, reset=flag)

    def describe(self) -> str:
        small = dataclasses.replace(self, events=3, rare_facts=1)
        example = render_example(small.batch(0, 1))
        return (
            f"Agent companion: agents with private rules (each of {self.num_features} feature "
            f"tokens votes for one of {self.num_labels} labels; inputs of "
            f"{self.features_per_input} features), {self.events} "
            f"events (input, answer) a sequence, {self.session_length} sequences a session, "
            f"{self.sessions} sessions an agent (rule drift from session {self.drift_session}, "
            f"{self.rare_facts} rare facts); a new agent every {self.agent_batches} batches."
            f"\nExample (3 events):\n{example}"
        )
