"""Optimizers as associative memories (Nested Learning, section 4).

An optimizer's state is a memory that compresses the stream of gradients of the level it
serves. Declared as a :class:`nested.Level`: the *memory* is the optimizer state (shaped like
each served parameter), the *context* is that parameter's gradient ``g_t`` (key and value),
the *objective* and *update rule* say how the state learns from each gradient, and the
memory's *read* with the current gradient as key is the step direction. :func:`as_optimizer`
turns such a level into an optax transformation, usable as the outer optimizer or, through
:func:`as_rule`, as a fast level's update rule:

    m_t      = rule step of the level on L(m; g_t)        (the optimizer level learns)
    update_t = -lr_t * direction(m_t; g_t)                (the served level moves)

where ``direction`` is the memory's read ``f(m; g)`` unless the memory defines another one
(Muon orthogonalises the read).

The optimizers of the paper as levels:

* :func:`momentum`: ``m`` with the dot-product objective ``-<m, g>`` and retention ``beta``:
  one step of lr 1 gives ``m_t = beta m_{t-1} + g_t`` (heavy ball; equals
  ``optax.sgd(lr, momentum=beta)``);
* :func:`deep_momentum`: ``m`` replaced by an MLP over the rows of the gradient, trained
  online by one gradient step on the L2 objective ``1/2 |m(g) - g|^2`` with retention; the
  step direction is ``m(g_t)``;
* :func:`muon`: the momentum read through Newton-Schulz orthogonalisation,
  ``update = -lr NS(m_t)`` (with ``m_t = beta m_{t-1} + (1 - beta) g_t`` this equals
  ``optax.contrib.muon(nesterov=False)`` on matrices; vectors are read without
  orthogonalisation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from nested.core import inner
from nested.core.level import Level, LevelState
from nested.learn import memories, objectives, rules


@dataclasses.dataclass(frozen=True)
class TensorMemory:
    """The state ``m`` shaped like the served parameter, read ``f(m; g) = m``.

    ``direction`` is what the served level steps along: ``m``, or ``NS(m)`` with
    ``orthogonalize`` (matrices only; ``ns_steps`` Newton-Schulz iterations).
    """

    orthogonalize: bool = False
    ns_steps: int = 5

    def init_like(self, leaf: jax.Array, key: jax.Array) -> Any:
        del key
        return {"m": jnp.zeros_like(leaf)}

    def apply(self, params: Any, g: jax.Array) -> jax.Array:
        return params["m"]

    def direction(self, params: Any, g: jax.Array) -> jax.Array:
        m = params["m"]
        if self.orthogonalize and m.ndim == 2:
            return rules.newton_schulz(m, self.ns_steps)
        return m


@dataclasses.dataclass(frozen=True)
class RowMLP:
    """An MLP memory ``R^n -> R^n`` applied to every row of the gradient (last axis ``n``),
    initialised near the identity map (residual form: ``f(g) = g + MLP(g)`` with ``W_out``
    starting at zero). Scalars and vectors are treated as one row."""

    hidden: int = 16
    depth: int = 2
    activation: str = "gelu"

    def _mlp(self, n: int) -> memories.MLP:
        return memories.MLP(n, n, self.hidden, depth=self.depth, activation=self.activation)

    def init_like(self, leaf: jax.Array, key: jax.Array) -> Any:
        n = leaf.shape[-1] if leaf.ndim else 1
        *first, last = self._mlp(n).init(key)
        return (*first, {"w": jnp.zeros_like(last["w"])})

    def apply(self, params: Any, g: jax.Array) -> jax.Array:
        rows = g.reshape(-1, g.shape[-1] if g.ndim else 1)
        mlp = self._mlp(rows.shape[-1])
        return (rows + mlp.apply(params, rows)).reshape(g.shape)


def momentum(beta: float = 0.9, *, name: str = "momentum") -> Level:
    """Heavy-ball momentum as a level: ``m_t = beta m_{t-1} + g_t`` (one step of lr 1 on
    ``-<m, g>`` after the decay ``1 - beta``)."""
    return Level(
        name,
        memory=TensorMemory(),
        objective=objectives.dot,
        update=rules.gradient_descent(1.0, decay=1.0 - beta),
    )


def muon(beta: float = 0.95, *, ns_steps: int = 5, name: str = "muon") -> Level:
    """Muon as a level: EMA momentum ``m_t = beta m_{t-1} + (1 - beta) g_t`` read through
    ``ns_steps`` Newton-Schulz iterations."""
    return Level(
        name,
        memory=TensorMemory(orthogonalize=True, ns_steps=ns_steps),
        objective=objectives.dot,
        update=rules.gradient_descent(1.0 - beta, decay=1.0 - beta),
    )


def deep_momentum(
    hidden: int = 16, *, lr: float = 0.1, beta: float = 0.9, name: str = "deep_momentum"
) -> Level:
    """Deep momentum as a level: an MLP over gradient rows learning ``m(g) ~ g`` online
    (one step of lr ``lr`` on ``1/2 |m(g) - g|^2``, weights decayed by ``1 - beta``)."""
    return Level(
        name,
        memory=RowMLP(hidden),
        objective=objectives.l2,
        update=rules.gradient_descent(lr, decay=1.0 - beta),
    )


def _check_optimizer_level(level: Level) -> None:
    if not hasattr(level.memory, "init_like"):
        raise ValueError(
            f"level {level.name!r}: an optimizer level's memory must be shaped like the served "
            f"parameters (init_like); got {type(level.memory).__name__}"
        )
    if level.gates:
        raise ValueError(
            f"level {level.name!r}: an optimizer level has no owner emitting gates; its rule "
            f"must use constants, not {sorted(level.gates)}"
        )


def as_optimizer(
    level: Level, learning_rate: rules.GateSpec, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """The optax transformation of an optimizer level (see the module docstring).

    ``learning_rate`` is a constant or the name of a gate (when used as a fast level's rule).
    ``seed`` initialises memories with random parameters (``RowMLP``).
    """
    _check_optimizer_level(level)

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
        states = []
        for leaf, key in zip(leaves, keys, strict=False):
            memory = level.memory.init_like(leaf, key)
            states.append(LevelState(memory, level.rule.transform.init(memory), None, level.name))
        return jax.tree.unflatten(treedef, states)

    def update(grads, state, params=None, **gates):
        del params
        lr = rules.gate_value(learning_rate, gates)

        def leaf(g, s):
            item = {"k": g, "v": g, "q": g}
            grad = inner.objective_grad(level, s.params, item)
            memory, opt_state = inner.rule_step(level, s.params, s.opt_state, grad, item)
            read = getattr(level.memory, "direction", level.memory.apply)
            step = -lr * read(memory, g)
            return step, s.replace(params=memory, opt_state=opt_state)

        grad_leaves, treedef = jax.tree.flatten(grads)
        outs = [leaf(g, s) for g, s in zip(grad_leaves, treedef.flatten_up_to(state), strict=True)]
        return treedef.unflatten([o[0] for o in outs]), treedef.unflatten([o[1] for o in outs])

    return optax.GradientTransformationExtraArgs(init, update)


def as_rule(level: Level, learning_rate: rules.GateSpec = "lr") -> rules.UpdateRule:
    """An optimizer level as a fast level's update rule; a string ``learning_rate`` is a gate
    the owner emits per token (in (0, 1))."""
    transform = as_optimizer(level, learning_rate)
    gates = {learning_rate: rules.DEFAULT_GATES["lr"]} if isinstance(learning_rate, str) else {}
    return rules.UpdateRule(transform, gates)
