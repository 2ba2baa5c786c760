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

**Rule kinds and families.** ``rule_kind`` changes the rule's kind: ``"linear"`` (above);
``"one_feature"``, the linear agent's weights replaced by ``2^r_f`` (``r_f`` the rank of ``w_f``
among the agent's features; votes, drift and facts' inputs unchanged): ``2^r > sum_{q<r} 2^q``,
so the input's feature of highest rank decides alone; ``"pairs"``, every pair ``f < g`` votes
for a label ``c_fg`` with weight ``w_fg ~ U[0.5, 1.5]`` and ``answer(x) = argmax_c sum_{f<g in
x} w_fg [c_fg = c]``, a rule ``(L, F, F)`` (upper triangle) no linear map of the one-hot
features computes (the drift moves ``drift_fraction`` of the pairs' votes). ``families``
(names of :data:`FAMILIES`, each a ``(k, rule_kind)``) makes every agent draw its family, from
(seed, row, index) alone: a mixture of agents in one batch. Inputs then differ in length; every
event holds ``input_width`` feature slots (default the largest k), a shorter input left-padded
with token 0, so an event is ``input_width + 1`` tokens whatever its agent's k.

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


RULE_KINDS = ("linear", "one_feature", "pairs")
# Agent families (module docstring): name -> (features per input, rule kind).
FAMILIES = {
    "k2": (2, "linear"),
    "k3": (3, "linear"),
    "k4": (4, "linear"),
    "one_feature": (3, "one_feature"),
    "pairs": (3, "pairs"),
}


@dataclasses.dataclass(frozen=True)
class Agent:
    """One agent: ``rule`` ``(num_labels, num_features)`` (a pair rule: ``(num_labels, F, F)``)
    before the drift and ``drifted`` after it; ``facts`` ``(rare_facts, k)`` inputs (feature
    ids) and ``fact_answers`` ``(rare_facts,)`` labels that break the rule; ``family`` its
    name in :data:`FAMILIES` (None: the task's own ``features_per_input`` and ``rule_kind``)."""

    rule: np.ndarray
    drifted: np.ndarray
    facts: np.ndarray
    fact_answers: np.ndarray
    family: str | None = None

    @property
    def features_per_input(self) -> int:
        return self.facts.shape[1]


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
      rule_kind: one of :data:`RULE_KINDS` (module docstring).
      families: names of :data:`FAMILIES` each agent draws from; empty: every agent is
        ``(features_per_input, rule_kind)``.
      input_width: feature slots of an event's input (shorter inputs left-padded with token
        0); None: the largest k of the agents.
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
    rule_kind: str = "linear"
    families: tuple[str, ...] = ()
    input_width: int | None = None

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
        if self.rule_kind not in RULE_KINDS:
            raise field_error(self.name, "rule_kind", self.rule_kind, f"use one of {RULE_KINDS}")
        if not isinstance(self.families, tuple | list) or not set(self.families) <= set(FAMILIES):
            raise field_error(
                self.name, "families", self.families, f"use a tuple of names of {list(FAMILIES)}"
            )
        object.__setattr__(self, "families", tuple(self.families))
        if self.rule_kind == "pairs" and self.features_per_input < 2:
            raise field_error(self.name, "rule_kind", "pairs", "use features_per_input >= 2")
        if max(self.agent_ks) > self.num_features:
            raise field_error(self.name, "families", self.families, "use k <= num_features")
        if self.input_width is not None and (
            not isinstance(self.input_width, int) or self.input_width < max(self.agent_ks)
        ):
            raise field_error(
                self.name,
                "input_width",
                self.input_width,
                f"use None or an int >= {max(self.agent_ks)}",
            )
        if self.text and self.width != self.features_per_input:
            raise field_error(
                self.name,
                "families",
                self.families,
                "a text task takes one k: leave families and input_width unset",
            )
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
    def agent_ks(self) -> tuple[int, ...]:
        """The features per input of the task's agents (of its families, or its own k)."""
        return tuple(sorted({FAMILIES[f][0] for f in self.families} or {self.features_per_input}))

    @property
    def width(self) -> int:
        """Feature slots of an event's input: ``input_width``, or the largest k."""
        return self.input_width or max(self.agent_ks)

    @property
    def event_length(self) -> int:
        """Tokens of an event: ``width + 1``; with ``text``, ``k + 5``."""
        return self.width + (5 if self.text else 1)

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
        """Tokens ``(..., E * event_length)`` of events under the token ids ``ids``; inputs
        of fewer than :attr:`width` features left-padded with token 0 (as are -1 ids)."""
        pad = [(0, 0)] * (inputs.ndim - 1) + [(max(self.width - inputs.shape[-1], 0), 0)]
        inputs = np.pad(inputs, pad, constant_values=-1)
        features = np.where(inputs >= 0, ids["features"][np.maximum(inputs, 0)], 0)
        labels = ids["labels"][answers][..., None]
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
        answer is predicted (the feature tokens; with ``text``, ``the <features> box is``);
        an input wider than :attr:`width` keeps all its features."""
        answers = np.zeros((*inputs.shape[:-1], 1), np.int64)  # any: cut off below
        tokens = self._words_encode(self._ids, inputs[..., None, :], answers)
        return tokens[..., : tokens.shape[-1] - (2 if self.text else 1)]  # no answer (and .)

    @property
    def answer_at(self) -> int:
        """Where in an event the answer is predicted from: its answer token's position."""
        return self.width + (3 if self.text else 0)

    def answers(self, rule: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """Labels ``(...,)`` of ``inputs`` ``(..., k)`` (feature ids) under ``rule``: a linear
        rule ``(L, F)`` summed over the input's features, a pair rule ``(L, F, F)`` over its
        pairs."""
        if rule.ndim == 2:
            return np.argmax(rule[:, inputs].sum(axis=-1), axis=0)
        i, j = np.triu_indices(inputs.shape[-1], k=1)
        low = np.minimum(inputs[..., i], inputs[..., j])
        high = np.maximum(inputs[..., i], inputs[..., j])
        return np.argmax(rule[:, low, high].sum(axis=-1), axis=0)

    def family(self, row: int, index: int) -> str | None:
        """The family of agent ``index`` of row ``row`` (None without ``families``)."""
        if not self.families:
            return None
        draw = rng_for(self.seed, f"family/{index}", row).integers(len(self.families))
        return self.families[draw]

    def agent(self, row: int, index: int = 0) -> Agent:
        """Agent ``index`` of batch row ``row``: drawn from (seed, row, index) alone, once."""
        return self._agents(int(row), int(index))

    @functools.cache  # noqa: B019 - frozen dataclass: the cache lives as long as the task
    def _agents(self, row: int, index: int) -> Agent:
        family = self.family(row, index)
        k, kind = FAMILIES[family] if family else (self.features_per_input, self.rule_kind)
        rng = rng_for(self.seed, f"agent/{index}", row)
        F, L = self.num_features, self.num_labels
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
        if kind == "one_feature":  # the same votes, each feature outweighing all below it
            decisive = 2.0 ** np.argsort(np.argsort(weights))
            rule, drifted = (np.where(r > 0, decisive, 0.0) for r in (rule, drifted))
            by_rule = self.answers(rule, facts)
            fact_answers = np.where(fact_answers == by_rule, (by_rule + 1) % L, fact_answers)
        elif kind == "pairs":
            rng = rng_for(self.seed, f"pairs/{index}", row)
            low, high = np.triu_indices(F, k=1)
            votes, weights = rng.integers(0, L, low.size), rng.uniform(0.5, 1.5, low.size)
            moved = rng.permutation(low.size)[: round(self.drift_fraction * low.size)]
            changed = votes.copy()
            changed[moved] = (votes[moved] + 1 + rng.integers(0, L - 1, moved.size)) % L
            rule, drifted = np.zeros((L, F, F)), np.zeros((L, F, F))
            rule[votes, low, high] = weights
            drifted[changed, low, high] = weights
            by_rule = self.answers(rule, facts)
            fact_answers = (by_rule + 1 + rng.integers(0, L - 1, size=by_rule.shape)) % L
        return Agent(rule, drifted, facts, fact_answers, family)

    def rule_at(self, agent: Agent, session: int) -> np.ndarray:
        return agent.drifted if session >= self.drift_session else agent.rule

    def draw_inputs(self, rng: np.random.Generator, count: int, k: int | None = None) -> np.ndarray:
        """``(count, k)`` sorted distinct feature ids per input (``k`` None: the task's)."""
        keys = rng.random((count, self.num_features))
        return np.sort(np.argsort(keys, axis=1)[:, : k or self.features_per_input], axis=1)

    def encode(self, inputs: np.ndarray, answers: np.ndarray) -> np.ndarray:
        """Tokens ``(..., E * event_length)`` of events: each input's feature tokens, then its
        answer's label token (with ``text``, the sentence's tokens)."""
        return self._words_encode(self._ids, inputs, answers)

    def sequence(
        self, agent: Agent, session: int, rng: np.random.Generator, *, first: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """One sequence of ``agent`` in ``session``: ``(inputs (E, k), answers (E,))``; the
        agent's ``first`` sequence starts with its rare facts."""
        inputs = self.draw_inputs(rng, self.events, agent.features_per_input)
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
        inputs = np.stack([self._padded(d[0]) for d in drawn])
        answers = np.stack([d[1] for d in drawn])
        return self.events_batch(inputs, answers, reset=step == 0)

    def _padded(self, inputs: np.ndarray) -> np.ndarray:
        """``inputs (E, k)`` left-padded with -1 to ``(E, width)``."""
        return np.pad(inputs, [(0, 0), (self.width - inputs.shape[1], 0)], constant_values=-1)

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
