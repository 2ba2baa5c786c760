"""The Agent Companion Model: one persistent, learning fast-weight state per agent beside a
frozen model.

A :class:`Companion` serves a trained run (any workdir whose model has a level with
``persist="stream"``): its slow weights are frozen; each agent owns only the carried fast state
of that model (a few kilobytes), kept in a :mod:`~nested.companion.store`. Operations:

* ``observe({agent: tokens})``: the model reads each agent's new tokens from the agent's state
  (every token is read once, its target the next token of the same request) and the state it
  leaves is stored, all agents of the call in one transaction;
* ``recall({agent: queries})``: for each query (a token list), the model's next-token
  distribution after it and the memories' read-out there, from the agent's state, without
  writing; an agent never observed answers from the learned initial state;
* ``consolidate``: levels that consolidate over a period (outer-loss levels such as CMS
  blocks) apply what they accumulated now;
* ``forget``, ``export_agent`` / ``import_agent`` (flax msgpack with the model's fingerprint).

Its parts, one module each: what a request may hold (:mod:`~nested.companion.inputs`), text
and the tokenizer (:mod:`~nested.companion.text`: a query or observation may be a string, and
a recall then answers each predicted token decoded, ``"text"``), the export file
(:mod:`~nested.companion.agent_file`: an import is checked in full before anything is written)
and the sizes of the jitted calls (:mod:`~nested.companion.buckets`).

Only finite states are served. An observe whose update would leave an agent's state non-finite
(or a recall whose answer would be) is refused for that agent (409), its stored state kept as
it was; a stored state that is not finite (written before these checks) is refused like a
damaged one.

Requests from many agents run as **one jitted call**: their states are gathered into a slab
(rows = agents), updated and scattered back, at bucketed sizes (rows padded to a power of two,
observations cut in pieces of the update period times a power of two, queries padded).

:meth:`Companion.warm` compiles every bucket size a request can make ahead of the first request
(``experiments/serve.py --warm_s``), cheapest first within a time budget.

Each stored state carries the fingerprint of the model that wrote it (architecture and
slow-weights step). A state of another architecture is refused with :class:`CompanionError`
(its arrays would compute nonsense). A state of the same architecture written with the slow
weights of another step (the run trained on since) is a choice, ``other_steps``: ``"serve"``
(the default) continues it on these weights, and its next observe stores it as theirs;
``"refuse"`` answers 409 for it. Replaying an agent's history onto the new weights is not
possible: the store keeps states, not the tokens that made them. :meth:`Companion.export_agent`
always works, whoever wrote the state: a user's data is never held hostage.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from nested.companion import agent_file, buckets, inputs
from nested.companion.inputs import (
    AGENT_ID,
    MAX_QUERIES,
    MAX_QUERY_TOKENS,
    MAX_STORED_TOKENS,
    MAX_TOKENS,
    CompanionError,
    check_agent_id,
)
from nested.companion.store import DamagedState, Record, SQLiteStore, Store
from nested.companion.text import encode_text, run_tokenizer
from nested.core import inner, outer_loss, probes
from nested.core.level import LevelState
from nested.run.sampling import stream_period

__all__ = [  # the public names (the limits and checks are inputs', run_tokenizer text's)
    "AGENT_ID",
    "MAX_QUERIES",
    "MAX_QUERY_TOKENS",
    "MAX_STORED_TOKENS",
    "MAX_TOKENS",
    "OTHER_STEPS",
    "Companion",
    "CompanionError",
    "agent_bytes",
    "check_agent_id",
    "run_tokenizer",
]


def _is_level_state(x) -> bool:
    return isinstance(x, LevelState)


class _Readout:
    """Probe: runs the carried levels as declared and keeps each call's reads ``o``."""

    def __init__(self, names: set[str]):
        self.names, self.reads = names, []

    def selects(self, level) -> bool:
        return level.name in self.names

    def run(self, level, state, ctx):
        with probes.probing(None):
            o, state = inner.run(level, state, ctx)
        self.reads.append(o)
        return o, state


class Companion:
    """A frozen trained model and a store of per-agent fast states (module docstring).

    ``trained``: a :class:`nested.run.loading.Trained`; ``store``: a :class:`Store`;
    ``max_batch``: the most agents in one call (larger requests are split); ``tokenizer``:
    ``"bytes"``, a ``tokenizer.json`` path, or None for the run's own (:func:`run_tokenizer`).
    """

    def __init__(
        self,
        trained,
        store: Store,
        *,
        max_batch: int = 256,
        top_k: int = 5,
        other_steps: str = "serve",
        tokenizer: str | None = None,
    ):
        if other_steps not in OTHER_STEPS:
            raise CompanionError(f"other_steps={other_steps!r}: use one of {OTHER_STEPS}")
        self.other_steps = other_steps
        program = trained.program
        # The run's own tokenizer may be gone (a corpus moved): then ids only, and text says why.
        self.tokenizer, self.tokenizer_error = None, None
        try:
            self.tokenizer = run_tokenizer(trained.experiment.task, program.vocab, tokenizer)
        except CompanionError as error:
            if tokenizer is not None:
                raise
            self.tokenizer_error = str(error)
        self.carried = sorted(
            level.name for level in program.system.fast_levels if level.persist == "stream"
        )
        if not self.carried:
            raise CompanionError(
                "this model keeps no fast state across sequences (no level with "
                "persist='stream'): there is nothing to learn per agent; train one with "
                "--config.levels.<name>.persist=stream"
            )
        self.program, self.params, self.store = program, trained.state.params, store
        self.fingerprint = json.dumps(trained.fingerprint, sort_keys=True)
        self.vocab = program.vocab
        self.max_batch, self.top_k = max_batch, top_k
        # Observations are cut where the model, learning, can stop and go on exactly.
        self.period = stream_period(program, self.params, learning=True)
        self.template = jax.tree.map(
            np.asarray, jax.jit(lambda p: program.start_fast(p, 1))(self.params)
        )
        self._observe = jax.jit(self._observe_fn)
        self._recall = jax.jit(self._recall_fn)

    @classmethod
    def open(
        cls,
        workdir: str | Path,
        store: Store | str | Path | None = None,
        *,
        step: int | None = None,
        **kwargs,
    ):
        """The companion of the run trained in ``workdir`` (its latest checkpoint; ``step``:
        that one), with the SQLite store at ``store`` (default ``<workdir>/companion.sqlite``)
        or a given :class:`Store`. The checkpoints of the served step and of every step that
        wrote a stored agent are pinned (:func:`nested.run.checkpoint.pin`): more training
        keeps them, so ``step`` can serve the weights that wrote the agents."""
        from nested.run import checkpoint
        from nested.run.loading import load_trained
        from nested.run.rundir import CHECKPOINTS

        if store is None or isinstance(store, str | Path):  # first: a busy store fails fast
            store = SQLiteStore(store or Path(workdir) / "companion.sqlite")
        try:
            companion = cls(load_trained(workdir, step), store, **kwargs)
        except BaseException:
            if isinstance(store, SQLiteStore):
                store.close()
            raise
        if isinstance(store, SQLiteStore):
            checkpoint.pin(Path(workdir) / CHECKPOINTS, companion.pin_name, companion.steps())
        return companion

    @property
    def pin_name(self) -> str:
        """The name this store's pin of checkpoints goes by (from the store's file)."""
        where = str(Path(self.store.path).resolve())
        return "companion-" + hashlib.sha256(where.encode()).hexdigest()[:12]

    def steps(self) -> set[int]:
        """The slow-weights steps this companion needs kept: the served one, and those of
        the stored agents of this architecture."""
        ours = json.loads(self.fingerprint)
        steps = {int(ours["step"])}
        for fingerprint in self.store.writers():
            theirs = _fingerprint(fingerprint)
            if theirs.get("architecture") == ours["architecture"] and "step" in theirs:
                steps.add(int(theirs["step"]))
        return steps

    def other_writers(self) -> list[str]:
        """One line per group of stored agents written by another model or slow-weights step
        than this one, saying what happens to them here."""
        lines = []
        ours = json.loads(self.fingerprint)
        for fingerprint, n in sorted(self.store.writers().items()):
            if fingerprint == self.fingerprint:
                continue
            theirs = _fingerprint(fingerprint)
            if theirs.get("architecture") != ours["architecture"]:
                what = "another model: refused (export them, or forget them)"
            elif self.other_steps == "serve":
                what = (
                    f"the slow weights of step {theirs.get('step')}: served on those of step "
                    f"{ours['step']} (--other_steps=refuse refuses them)"
                )
            else:
                what = f"the slow weights of step {theirs.get('step')}: refused (--other_steps)"
            lines.append(f"{n} agent(s) written by {what}")
        return lines

    # -- states ------------------------------------------------------------------------------

    def fresh(self):
        """The state an unknown agent starts from (the learned initial state), one row."""
        return self.template

    def check_writer(self, fingerprint: str, what: str) -> None:
        """Raise :class:`CompanionError` (409) when a state with ``fingerprint`` may not be
        served here: another architecture always, another slow-weights step when
        ``other_steps="refuse"``."""
        if fingerprint == self.fingerprint:
            return
        theirs, ours = _fingerprint(fingerprint), json.loads(self.fingerprint)
        if theirs.get("architecture") != ours["architecture"]:
            raise CompanionError(
                f"{what} was written by another model (architecture "
                f"{theirs.get('architecture')}, this one {ours['architecture']}); export it and "
                f"import it into the model that wrote it, or forget it",
                status=409,
            )
        if self.other_steps == "refuse":
            raise CompanionError(
                f"{what} was written with the slow weights of step {theirs.get('step')}, these "
                f"are of step {ours['step']}; serve with --other_steps=serve to continue it on "
                f"these weights, or export it",
                status=409,
            )

    def _decode(self, agent_id: str, record: Record):
        self.check_writer(record.fingerprint, f"agent {agent_id!r}: its stored state")
        state = serialization.from_bytes(self.template, record.state)
        if not inputs.finite(state):
            raise CompanionError(
                f"agent {agent_id!r}: its stored state is not finite (NaN or inf); forget the "
                f"agent or import a state exported before",
                status=409,
            )
        return state

    def states(self, ids: Sequence[str]) -> tuple[dict[str, Any], dict[str, int], dict[str, str]]:
        """``(state per agent, tokens observed per agent, error per agent)`` for ``ids``:
        fresh for unknown agents; a damaged or foreign state is an error for that agent only."""
        stored = self.store.get_many(ids)
        states, tokens, errors = {}, {}, {}
        for agent_id in ids:
            record = stored.get(agent_id)
            if isinstance(record, DamagedState):
                errors[agent_id] = str(record)
            elif record is None:
                states[agent_id], tokens[agent_id] = self.fresh(), 0
            else:
                try:
                    states[agent_id] = self._decode(agent_id, record)
                except (CompanionError, ValueError) as error:
                    errors[agent_id] = str(error)
                    continue
                tokens[agent_id] = record.tokens
        return states, tokens, errors

    # -- the jitted calls --------------------------------------------------------------------

    def _observe_fn(self, params, fast, tokens, targets, mask):
        fast = self.program.start_fast(params, tokens.shape[0], fast)
        _, fast = self.program.apply(params, tokens, fast, targets=targets, mask=mask)
        return fast

    def _recall_fn(self, params, fast, tokens, last):
        fast = self.program.start_fast(params, tokens.shape[0], fast)
        readout = _Readout(set(self.carried))
        try:
            with probes.probing(readout):
                logits, _ = self.program.apply(params, tokens, fast)
        except ValueError:  # a carried level runs inside a scan of the model: no read-out
            logits, _ = self.program.apply(params, tokens, fast)
            readout.reads = []
        rows = jnp.arange(tokens.shape[0])
        probs = jax.nn.softmax(logits[rows, last, : self.vocab].astype(jnp.float32), axis=-1)
        top, ids = jax.lax.top_k(probs, self.top_k)
        reads = [o[rows, last].reshape(tokens.shape[0], -1) for o in readout.reads]
        reads = jnp.concatenate(reads, axis=-1) if reads else jnp.zeros((tokens.shape[0], 0))
        return ids, top, reads.astype(jnp.float32)

    def buckets(self) -> list[tuple[str, int, int]]:
        """Every ``(kind, rows, length)`` a request can make the jitted calls run, cheapest
        first (:func:`nested.companion.buckets.sizes`)."""
        return buckets.sizes(self.max_batch, self.period)

    def warm(self, budget_s: float) -> tuple[int, int, float]:
        """Compile and run once (on fresh states, nothing stored) the bucket sizes of
        :meth:`buckets`, cheapest first, until ``budget_s`` seconds have passed (the last may
        overrun by one compile), so that requests of those sizes never wait for a compile.
        Returns ``(sizes warmed, sizes in all, seconds)``."""
        sizes, began, done = self.buckets(), time.perf_counter(), 0
        for kind, rows, length in sizes:
            if time.perf_counter() - began >= budget_s:
                break
            slab = buckets.slab([self.template] * rows, self.template)
            tokens = np.zeros((rows, length), np.int32)
            if kind == "observe":
                mask = np.zeros((rows, length), np.float32)
                jax.block_until_ready(self._observe(self.params, slab, tokens, tokens, mask))
            else:
                last = np.zeros((rows,), np.int32)
                jax.block_until_ready(self._recall(self.params, slab, tokens, last))
            done += 1
        return done, len(sizes), time.perf_counter() - began

    # -- the operations ----------------------------------------------------------------------

    def check_tokens(self, tokens: Any, field: str, *, limit: int, multiple: int = 1) -> np.ndarray:
        """``tokens`` (ids, or text to encode) checked: :func:`nested.companion.inputs.check_tokens`
        against this model's vocabulary."""
        return inputs.check_tokens(
            tokens, field, vocab=self.vocab, limit=limit, multiple=multiple, encode=self.encode
        )

    def encode(self, text: str, field: str) -> np.ndarray:
        """The token ids of ``text`` (:func:`nested.companion.text.encode_text`)."""
        return encode_text(self.tokenizer, text, field, self.tokenizer_error)

    def observe(self, requests: Mapping[str, Sequence[int] | str]) -> dict[str, dict]:
        """Learn from each agent's ``tokens`` (ids, or text to encode); returns per agent
        ``{"tokens": total observed}`` or ``{"error": message}`` (a damaged or foreign state:
        that agent only). All the states are written in one transaction. Raises
        :class:`CompanionError` for a bad request (nothing written)."""
        checked = {
            check_agent_id(a): self.check_tokens(
                t, f"agent {a!r}: tokens", limit=MAX_TOKENS, multiple=self.period
            )
            for a, t in requests.items()
        }
        out: dict[str, dict] = {}
        ids = list(checked)
        for start in range(0, len(ids), self.max_batch):
            out.update(
                self._observe_batch({a: checked[a] for a in ids[start : start + self.max_batch]})
            )
        return out

    def _observe_batch(self, requests: dict[str, np.ndarray]) -> dict[str, dict]:
        states, tokens, errors = self.states(list(requests))
        out = {a: {"error": e} for a, e in errors.items()}
        # Each request in pieces of period * 2^j tokens, largest first; round r runs every
        # agent's r-th piece, one call per distinct piece length.
        pieces = {a: buckets.pieces(len(requests[a]), self.period) for a in states}
        offsets = dict.fromkeys(states, 0)
        for round_ in range(max((len(p) for p in pieces.values()), default=0)):
            by_length: dict[int, list[str]] = {}
            for a, p in pieces.items():
                if round_ < len(p):
                    by_length.setdefault(p[round_], []).append(a)
            for length, agents in by_length.items():
                states.update(self._run_piece(agents, states, requests, offsets, length))
                for a in agents:
                    offsets[a] += length
        records = {}
        for a, state in states.items():
            total = tokens[a] + len(requests[a])
            if not inputs.finite(state):
                out[a] = {
                    "error": f"agent {a!r}: this observe would leave its state non-finite (NaN "
                    f"or inf); refused, the stored state is kept as it was"
                }
            elif total > MAX_STORED_TOKENS:
                out[a] = {"error": f"agent {a!r}: more than {MAX_STORED_TOKENS} tokens observed"}
            else:
                records[a] = Record(serialization.to_bytes(state), self.fingerprint, total)
                out[a] = {"tokens": total}
        if records:
            self.store.put_many(records)
        return out

    def _run_piece(self, agents, states, requests, offsets, length) -> dict[str, Any]:
        rows = buckets.pow2(len(agents))
        tokens = np.zeros((rows, length), np.int32)
        targets = np.zeros((rows, length), np.int32)
        mask = np.zeros((rows, length), np.float32)
        for i, a in enumerate(agents):
            request, at = requests[a], offsets[a]
            tokens[i] = request[at : at + length]
            following = request[at + 1 : at + length + 1]  # the next token of the request
            targets[i, : following.size] = following
            mask[i, : following.size] = 1.0
        slab = buckets.slab([states[a] for a in agents], self.template)
        new = jax.device_get(self._observe(self.params, slab, tokens, targets, mask))
        return {a: buckets.row(new, i) for i, a in enumerate(agents)}

    def recall(self, requests: Mapping[str, Sequence[Sequence[int] | str]]) -> dict[str, dict]:
        """For each agent, each query's (ids, or text to encode) ``top_k`` next tokens with
        their probabilities and the memories' read-out at its last token, from the agent's
        state (nothing written): ``{"tokens": (Q, k), "probs": (Q, k), "readout": (Q, n)}`` as
        lists, and with a tokenizer ``"text"`` ``(Q, k)``, each token decoded; or
        ``{"error": message}``."""
        checked = {}
        for a, queries in requests.items():
            check_agent_id(a)
            if not isinstance(queries, Sequence) or not 1 <= len(queries) <= MAX_QUERIES:
                raise CompanionError(
                    f"agent {a!r}: queries: give 1 to {MAX_QUERIES} queries (lists of token ids)"
                )
            checked[a] = [
                self.check_tokens(q, f"agent {a!r}: query {i}", limit=MAX_QUERY_TOKENS)
                for i, q in enumerate(queries)
            ]
        states, _, errors = self.states(list(checked))
        out: dict[str, dict] = {a: {"error": e} for a, e in errors.items()}
        rows = [(a, q) for a in states for q in checked[a]]
        results = []
        for start in range(0, len(rows), self.max_batch):
            results += self._recall_rows(rows[start : start + self.max_batch], states)
        start = 0
        for a in states:  # the rows are grouped by agent, in this order
            mine, start = results[start : start + len(checked[a])], start + len(checked[a])
            if not all(inputs.finite((r["probs"], r["readout"])) for r in mine):
                out[a] = {"error": f"agent {a!r}: the model's answer from its state is not finite"}
                continue
            out[a] = {
                key: [r[key].tolist() for r in mine] for key in ("tokens", "probs", "readout")
            }
            if self.tokenizer is not None:
                decode = self.tokenizer.decode
                out[a]["text"] = [[decode([t]) for t in row] for row in out[a]["tokens"]]
        return out

    def _recall_rows(self, rows, states) -> list[dict]:
        n = buckets.pow2(len(rows))
        length = buckets.query_length(max(len(q) for _, q in rows), self.period)
        tokens = np.zeros((n, length), np.int32)
        last = np.zeros((n,), np.int32)
        for i, (_, q) in enumerate(rows):
            tokens[i, : len(q)], last[i] = q, len(q) - 1
        slab = buckets.slab([states[a] for a, _ in rows], self.template)
        ids, probs, reads = jax.device_get(self._recall(self.params, slab, tokens, last))
        return [
            {"tokens": ids[i], "probs": probs[i], "readout": reads[i]} for i in range(len(rows))
        ]

    def consolidate(self, agent_ids: Sequence[str]) -> dict[str, dict]:
        """Write into the slow-consolidating levels (outer-loss levels carried across
        sequences, e.g. CMS blocks) what each agent accumulated since their last update, now
        (:func:`nested.core.outer_loss.consolidate`); per agent ``{"tokens": ...}`` or
        ``{"error": ...}``. A model without such a level raises :class:`CompanionError`."""
        levels = {
            level.name: level
            for level in self.program.system.fast_levels
            if level.learns_outer_loss and level.persist == "stream"
        }
        if not levels:
            raise CompanionError(
                "consolidate: this model has no level that consolidates over a period (an "
                "outer-loss level such as a CMS block with persist='stream'); its memories "
                "write at every update already",
                status=409,
            )
        ids = [check_agent_id(a) for a in agent_ids]
        states, tokens, errors = self.states(ids)
        out: dict[str, dict] = {a: {"error": e} for a, e in errors.items()}

        def flush(x):
            if isinstance(x, LevelState) and x.level in levels:
                return outer_loss.consolidate(levels[x.level], x)
            return x

        records = {}
        for a, state in states.items():
            new = jax.device_get(jax.tree.map(flush, state, is_leaf=_is_level_state))
            records[a] = Record(serialization.to_bytes(new), self.fingerprint, tokens[a])
            out[a] = {"tokens": tokens[a]}
        if records:
            self.store.put_many(records)
        return out

    def forget(self, agent_id: str) -> bool:
        """Remove the agent's state (it starts over from the learned initial state)."""
        return self.store.delete(check_agent_id(agent_id))

    def tokens_observed(self, agent_id: str) -> int:
        """Tokens the agent has observed (0 for an unknown agent)."""
        states, tokens, errors = self.states([check_agent_id(agent_id)])
        if errors:
            raise CompanionError(errors[agent_id], status=409)
        return tokens[agent_id]

    def export_agent(self, agent_id: str) -> bytes:
        """The agent's state as a portable file (flax msgpack: the fingerprint of the model
        that wrote it, tokens, state), whichever model wrote it; an unknown agent exports the
        learned initial state. Only a damaged state cannot be exported (409)."""
        record = self.store.get_many([check_agent_id(agent_id)]).get(agent_id)
        if isinstance(record, DamagedState):
            raise CompanionError(str(record), status=409)
        if record is None:
            state = serialization.to_state_dict(self.fresh())
            return agent_file.write(self.fingerprint, 0, state)
        state = serialization.msgpack_restore(record.state)
        return agent_file.write(record.fingerprint, record.tokens, state)

    def import_agent(self, agent_id: str, data: bytes) -> int:
        """Store a state exported by :meth:`export_agent` as ``agent_id``'s, keeping the
        fingerprint of the model that wrote it (refused as :meth:`check_writer` says);
        returns its tokens observed. Everything the file carries is checked first (module
        docstring); a file that fails is refused with :class:`CompanionError` naming what is
        wrong, and nothing is written."""
        check_agent_id(agent_id)
        fingerprint, tokens, state = agent_file.read(data)
        try:
            self.check_writer(fingerprint, "import: the state")
        except CompanionError as error:
            raise CompanionError(str(error)) from None  # a bad request, not a conflict
        agent_file.check_state(state, serialization.to_state_dict(self.template))
        state = serialization.from_state_dict(self.template, state)
        self.store.put_many({agent_id: Record(serialization.to_bytes(state), fingerprint, tokens)})
        return tokens


OTHER_STEPS = ("serve", "refuse")


def _fingerprint(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def agent_bytes(companion: Companion) -> int:
    """Bytes of one agent's fast state arrays (what the store keeps, before serialization)."""
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(companion.template)))
