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

**Text** (``text=True``): the same agents and rules, each event a short sentence, ``the
<f_1> .. <f_k> box is <label> .``, feature ``f`` the word ``FEATURE_WORDS[f]`` and label ``c``
the colour ``LABEL_WORDS[c]`` ("the heavy round wooden box is red ."); an event is ``k + 5``
tokens, scored at ``is`` (predict the colour). Its tokens come from a tokenizer in which every
word of the task is one token: ``tokenizer=None`` builds the task's own word-level tokenizer
(``tokenizers``' ``WordLevel`` over :data:`SPECIAL`, the template words, the first F feature
and L label words, in that order: ``<|endoftext|>`` is 0), or ``tokenizer`` is the path of a
``tokenizer.json`` (e.g. the corpus tokenizer ``experiments/prepare.py`` saved) that gives each
word one token, checked when the task is built. :meth:`text_tokenizer` gives it to the
companion service, which then takes and answers text.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import numpy as np

from nested.data import corpus
from nested.data.batch import Batch, check_request, field_error, make_batch, render_example, rng_for

# The text variant's words (module docstring): "the <features> box is <label> ."
SPECIAL = (corpus.BPE_EOS, "[UNK]")
TEMPLATE = ("the", "box", "is", ".")
FEATURE_WORDS = (
    "heavy", "light", "round", "square", "wooden", "metal", "glass", "paper",
    "small", "large", "old", "new", "soft", "hard", "warm", "cold",
    "smooth", "rough", "shiny", "dull", "tall", "flat", "thin", "thick",
    "loud", "quiet", "fast", "slow", "sweet", "sour", "wet", "dry",
    "empty", "full", "clean", "dirty", "bright", "dark", "cheap", "rare",
    "plain", "fancy", "broken", "sealed", "striped", "dotted", "narrow", "wide",
)  # fmt: skip
LABEL_WORDS = (
    "red", "blue", "green", "yellow", "purple", "orange", "white", "black",
    "grey", "pink", "brown", "cyan", "gold", "silver", "violet", "teal",
)  # fmt: skip


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
      text: events as sentences (module docstring); F <= 48 and L <= 16 words.
      tokenizer: with ``text``, the path of a ``tokenizer.json`` giving each of the task's
        words one token; None: the task's own word-level tokenizer.
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
    text: bool = False
    tokenizer: str | None = None

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
        if not isinstance(self.text, bool):
            raise field_error(self.name, "text", self.text, "use True or False")
        if self.text:
            for field, words in (("num_features", FEATURE_WORDS), ("num_labels", LABEL_WORDS)):
                if getattr(self, field) > len(words):
                    raise field_error(
                        self.name, field, getattr(self, field), f"use <= {len(words)} with text"
                    )
            self._ids  # noqa: B018 - a tokenizer that does not fit fails here, before training
        elif self.tokenizer is not None:
            raise field_error(self.name, "tokenizer", self.tokenizer, "set text=True to use one")

    @property
    def vocab_size(self) -> int:
        """1 + F + L (token 0 is unused); with ``text``, the tokenizer's vocabulary."""
        if self.text:
            return self.text_tokenizer().vocab_size
        return 1 + self.num_features + self.num_labels

    @property
    def event_length(self) -> int:
        """Tokens of an event: ``k + 1``; with ``text``, ``k + 5``."""
        return self.features_per_input + (5 if self.text else 1)

    @property
    def seq_len(self) -> int:
        return self.events * self.event_length

    @functools.cache  # noqa: B019 - frozen dataclass: the cache lives as long as the task
    def text_tokenizer(self) -> corpus.Tokenizer | None:
        """The tokenizer of a ``text`` task (module docstring); None without ``text``."""
        if not self.text:
            return None
        if self.tokenizer is not None:
            if not Path(self.tokenizer).is_file():
                raise field_error(
                    self.name,
                    "tokenizer",
                    self.tokenizer,
                    "no such file; give the path of a tokenizer.json, or None for the task's own",
                )
            try:
                return corpus.load_tokenizer(self.tokenizer)
            except corpus.PrepareError as error:
                raise field_error(self.name, "tokenizer", self.tokenizer, str(error)) from None
        from tokenizers import Tokenizer as HF
        from tokenizers import models, pre_tokenizers

        words = SPECIAL + TEMPLATE + self.words
        hf = HF(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL[1]))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return corpus.Tokenizer("words", len(words), 0, corpus.encode_with(hf), hf)

    @property
    def words(self) -> tuple[str, ...]:
        """The feature words, then the label words, of a ``text`` task."""
        return FEATURE_WORDS[: self.num_features] + LABEL_WORDS[: self.num_labels]

    def sentence(self, inputs, answer) -> str:
        """The text of one event: ``inputs`` ``(k,)`` feature ids, ``answer`` a label."""
        features = " ".join(FEATURE_WORDS[f] for f in inputs)
        return f"the {features} box is {LABEL_WORDS[answer]} ."

    @functools.cached_property
    def _ids(self) -> dict[str, np.ndarray]:
        """Token ids: ``features`` ``(F,)``, ``labels`` ``(L,)``, ``template`` (the, box, is,
        .); a text tokenizer that does not give every word one token is refused."""
        F, L = self.num_features, self.num_labels
        if not self.text:
            return {"features": 1 + np.arange(F), "labels": 1 + F + np.arange(L)}
        tok = self.text_tokenizer()
        ids = {}
        for word in TEMPLATE + self.words:
            found = tok.encode(word)
            if len(found) != 1:
                raise field_error(
                    self.name,
                    "tokenizer",
                    self.tokenizer,
                    f"it encodes the word {word!r} as {len(found)} tokens; the text task needs "
                    f"one token a word (leave tokenizer=None for the task's own)",
                )
            ids[word] = int(found[0])
        out = {
            "features": np.array([ids[w] for w in FEATURE_WORDS[:F]]),
            "labels": np.array([ids[w] for w in LABEL_WORDS[:L]]),
            "template": np.array([ids[w] for w in TEMPLATE]),
        }
        for f in range(F):  # every word in a sentence: one token each, as alone
            inputs = (f + np.arange(self.features_per_input)) % F
            expected = self._words_encode(out, inputs, np.asarray(f % L))
            found = tok.encode(self.sentence(inputs, f % L))
            if not np.array_equal(found, expected):
                raise field_error(
                    self.name,
                    "tokenizer",
                    self.tokenizer,
                    f"it encodes {self.sentence(inputs, f % L)!r} otherwise than word by word; "
                    f"the text task needs one token a word (leave tokenizer=None for its own)",
                )
        return out

    def _words_encode(self, ids, inputs: np.ndarray, answers: np.ndarray) -> np.ndarray:
        """Tokens ``(..., E * event_length)`` of events under the token ids ``ids``."""
        features, labels = ids["features"][inputs], ids["labels"][answers][..., None]
        if self.text:
            the, box, is_, stop = (
                np.broadcast_to(t, (*inputs.shape[:-1], 1)) for t in ids["template"]
            )
            tokens = np.concatenate([the, features, box, is_, labels, stop], axis=-1)
        else:
            tokens = np.concatenate([features, labels], axis=-1)
        return tokens.reshape(*tokens.shape[:-2], -1)

    @property
    def agent_batches(self) -> int:
        """Training batches per agent: ``sessions * session_length``."""
        return self.sessions * self.session_length

    def label_token(self, label):
        """The token ids of labels ``label`` (any shape)."""
        return self._ids["labels"][np.asarray(label)]

    def query_tokens(self, inputs: np.ndarray) -> np.ndarray:
        """Tokens ``(..., q)`` of queries ``inputs`` ``(..., k)``: each event up to where its
        answer is predicted (the feature tokens; with ``text``, ``the <features> box is``)."""
        answers = np.zeros((*inputs.shape[:-1], 1), np.int64)  # any: cut off below
        return self._words_encode(self._ids, inputs[..., None, :], answers)[..., : self.answer_at]

    @property
    def answer_at(self) -> int:
        """Where in an event the answer is predicted from: its answer token's position."""
        return self.features_per_input + (3 if self.text else 0)

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
        """Tokens ``(..., E * event_length)`` of events: each input's feature tokens, then its
        answer's label token (with ``text``, the sentence's tokens)."""
        return self._words_encode(self._ids, inputs, answers)

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
        the target at the token before it (its last feature token; with ``text``, ``is``)."""
        tokens = self.encode(inputs, answers)
        targets = np.zeros_like(tokens)
        targets[:, :-1] = tokens[:, 1:]
        mask = np.zeros(tokens.shape, np.float32)
        mask[:, self.answer_at - 1 :: self.event_length] = 1.0
        flag = np.zeros(tokens.shape, np.float32)
        flag[:, 0] = float(reset)
        return make_batch(tokens, targets, mask, reset=flag)

    def describe(self) -> str:
        small = dataclasses.replace(self, events=3, rare_facts=1)
        batch = small.batch(0, 1)
        example = render_example(batch)
        if self.text:
            words = self.text_tokenizer().decode(batch.inputs[0, : self.event_length])
            example += f"\nThe first event as text: {words!r}"
        return (
            f"Agent companion: agents with private rules (each of {self.num_features} feature "
            f"tokens votes for one of {self.num_labels} labels; inputs of "
            f"{self.features_per_input} features), {self.events} "
            f"events (input, answer) a sequence, {self.session_length} sequences a session, "
            f"{self.sessions} sessions an agent (rule drift from session {self.drift_session}, "
            f"{self.rare_facts} rare facts); a new agent every {self.agent_batches} batches."
            f"\nExample (3 events):\n{example}"
        )
