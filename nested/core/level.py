"""``Level``: the declaration of one optimisation problem of a nested system.

A level (Nested Learning, Definition 3) is an objective ``L``, a context ``C`` (the stream it
learns from), a parameter set ``Theta`` and an update frequency. Here:

* ``memory``: the parameter set and its read ``f_theta(k)`` (:mod:`nested.memories`); for the
  outermost level, a factory ``rngs -> flax.nnx.Module`` building the whole model;
* ``objective``: the local loss of one context item (:mod:`nested.objectives`), or for the
  outermost level the outer loss ``(logits, batch) -> (loss, metrics)``;
* ``update``: the update rule, an optax transformation, with data-dependent gates for fast
  levels (:mod:`nested.rules`);
* ``every``: the update period in tokens of the stream: 1 updates at each token; ``C`` once
  per chunk of ``C`` tokens with mini-batch semantics (all gradients of a chunk are taken at the
  chunk-start state; token ``t`` reads the state after the chunk's updates up to ``t``);
  ``"step"`` marks the outermost level, updated once per training step;
* ``persist``: ``"sequence"`` resets the fast state to its learned initial value at every
  sequence; ``"stream"`` carries it across sequences (and sessions).

Levels are frozen and hashable, so they can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import optax
from flax import nnx, struct

from nested.learn.objectives import OuterLoss
from nested.learn.rules import Gate, Rule, accumulated, as_rule

PERSIST = ("sequence", "stream")
READS = ("after_write", "chunk_start")
RESERVED_ITEM_KEYS = ("k", "v", "q")


class InitialState(nnx.Param):
    """The learned initial state ``theta_0`` of a fast level: a slow parameter like any other
    (the owner level trains it), but fast states start from it, so it stays float32 when the
    model computes in a lower precision (``nested.compile(..., compute_dtype=...)``)."""


@struct.dataclass
class LevelState:
    """The fast state of one memory instance of a level, with leading ``(B, H)`` dims.

    ``params``: the memory parameters; ``opt_state``: the update rule's state (momentum...);
    ``cache``: other per-stream state the owner layer keeps with it (e.g. a convolution's last
    inputs), or None; ``level``: the level's name (static), so a model's fast states can be
    selected per level.
    """

    params: Any
    opt_state: Any
    cache: Any = None
    level: str = struct.field(pytree_node=False, default="")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of a nested system. See the module docstring for the fields.

    ``read``: ``"after_write"`` (default) reads ``f_{theta_t}(q_t)`` after the write at ``t``;
    ``"chunk_start"`` reads the state at the start of the token's chunk (Titans-style; with
    ``every=1`` that is the state before the token's own write).
    ``truncate``: if set, gradients of outer levels stop flowing through this level's state
    every ``truncate`` tokens (truncated backpropagation through the inner loop).
    ``first_order``: for a level learning from the outer loss over its periods (a CMS
    block, ``objective=objectives.outer_loss``): outer levels take its period gradients as
    constants (first-order meta-learning, as first-order MAML). The outer gradient still flows
    through the state each update starts from and through everything the model computes with
    it, not through the period gradient itself, so the outer backward pass skips the backward
    of each period's backward pass. Forward values are unchanged. (A key-value memory level
    has none: its keys and values reach the outer loss only through the gradients it writes.)
    ``chunk``: compute chunk in tokens (a multiple of ``every``): the block rematerialised by
    ``jax.checkpoint`` in the generic path, the chunk size of a linear kernel; ``None`` picks
    one. It changes no result.
    ``accumulate``: with ``C > 1`` (and ``every=1``) the rule's updates are summed and applied
    every ``C`` tokens of the stream, the sum and count in the rule state
    (:func:`nested.rules.accumulated`), so the period may span calls and sequences of a
    carried stream: a slow memory of a continuum (``read="chunk_start"`` reads the last
    applied state). The generic loop runs it.

    Which code runs the level follows from these fields alone: a kernel of
    :mod:`nested.core.kernels` where one implements exactly this declaration, else the generic
    inner loop (:func:`nested.core.inner.run`). Equal declarations compare and hash equal.
    """

    name: str
    memory: Any
    objective: Callable[..., Any]
    update: Rule | optax.GradientTransformation
    every: int | Literal["step"] = 1
    persist: Literal["sequence", "stream"] = "sequence"
    read: Literal["after_write", "chunk_start"] = "after_write"
    truncate: int | None = None
    first_order: bool = False
    chunk: int | None = None
    accumulate: int = 1

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Level.name must be a Python identifier, got {self.name!r}")
        where = f"Level {self.name!r}"
        if not (self.every == "step" or _positive_int(self.every)):
            raise ValueError(
                f"{where}: every={self.every!r} must be a positive int (tokens per update) "
                f"or 'step' (the outermost level)"
            )
        if self.persist not in PERSIST:
            raise ValueError(f"{where}: persist={self.persist!r}; use one of {PERSIST}")
        if self.read not in READS:
            raise ValueError(f"{where}: read={self.read!r}; use one of {READS}")
        if not isinstance(self.first_order, bool):
            raise ValueError(f"{where}: first_order={self.first_order!r} must be True or False")
        if self.first_order and not self.learns_outer_loss:
            raise ValueError(
                f"{where}: first_order=True applies to levels that learn from the outer "
                "loss over its periods (objective=nested.objectives.outer_loss, e.g. CMS blocks); "
                "a key-value memory's keys and values would get no outer gradient"
            )
        if not callable(self.objective):
            raise ValueError(f"{where}: objective must be callable, got {self.objective!r}")
        if not _positive_int(self.accumulate):
            raise ValueError(f"{where}: accumulate={self.accumulate!r} must be an int >= 1")
        if self.accumulate > 1 and (self.every != 1 or self.learns_outer_loss):
            raise ValueError(
                f"{where}: accumulate={self.accumulate} sums a per-token rule's updates over "
                f"its period; it takes every=1 (got every={self.every!r}) and a local objective"
            )
        rule = self.rule  # raises on a bad update (or a retaining rule accumulated)
        if self.is_outer:
            if not callable(self.memory):
                raise ValueError(
                    f"{where}: the outermost level's memory must be a model factory "
                    f"(rngs -> flax.nnx.Module), got {type(self.memory).__name__}"
                )
            return
        memory_ok = hasattr(self.memory, "apply") and (
            hasattr(self.memory, "init") or hasattr(self.memory, "init_like")
        )
        if not memory_ok:
            raise ValueError(
                f"{where}: memory {type(self.memory).__name__} has no apply() and init(); "
                f"use a nested.memories memory (Linear, MLP) or implement the Memory protocol"
            )
        for field in ("truncate", "chunk"):
            value = getattr(self, field)
            if value is not None and not (_positive_int(value) and value % self.every == 0):
                raise ValueError(
                    f"{where}: {field}={value!r} must be a positive multiple of every={self.every}"
                )
        clash = set(self.gates) & set(RESERVED_ITEM_KEYS)
        if clash:
            raise ValueError(f"{where}: gate names {sorted(clash)} clash with the items k, v, q")
        if rule.retain is not None and rule.retain not in rule.gates:
            raise ValueError(f"{where}: retain gate {rule.retain!r} is not among the rule's gates")

    @property
    def is_outer(self) -> bool:
        return self.every == "step"

    @property
    def learns_outer_loss(self) -> bool:
        """Whether the level learns from the outer loss over its periods (a model-level
        memory such as a CMS block, :mod:`nested.core.outer_loss`) rather than from a local loss."""
        return isinstance(self.objective, OuterLoss)

    @property
    def rule(self) -> Rule:
        """The update as a rule (:func:`nested.rules.as_rule`), accumulated over
        ``accumulate`` tokens when that is more than 1."""
        rule = as_rule(self.update)
        if self.accumulate == 1:
            return rule
        try:
            return accumulated(rule, self.accumulate)
        except ValueError as error:
            raise ValueError(f"Level {self.name!r}: {error}") from None

    @property
    def gates(self) -> Mapping[str, Gate]:
        """Every gate the owner must emit: the rule's and the objective's."""
        return {**self.rule.gates, **getattr(self.objective, "gates", {})}
