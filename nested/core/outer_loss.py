"""Levels that learn from the outer loss: dynamic evaluation of a model, period by period.

A fast level whose objective is :class:`nested.objectives.OuterLoss` learns from the *outer*
objective restricted to the tokens of its period rather than from a local loss of (key, value)
items: its memory is a part of the model (a CMS block, say). The scheduler then runs the model
over spans of ``w`` tokens, ``w`` the shortest period among such levels, carrying every fast
state (layer-local memories keep running inside each span). After each span it takes the
gradient of the span's summed token losses with respect to every such memory (each sequence of
the batch has its own copy, so these are per-sequence gradients), adds it to the level's
accumulator, and at multiples of the level's period ``C`` steps the level's rule on the mean
accumulated gradient:

    g = (1/C) sum_{t in the last C tokens} grad_theta l_t(theta)      when tick % C == 0
    theta <- theta + rule(g)                                           (else unchanged)

So the parameters change exactly at multiples of ``C`` and nowhere else, every gradient of a
period is taken at the same parameters (mini-batch semantics), and token ``t`` is predicted
with the parameters from before its span was learned (predict, then learn). The outer level
differentiates through all of it (second order through every span's gradient), so it
meta-learns the blocks' initial parameters; a ``first_order`` level's gradients are constants
to it (no backward of the span's backward pass).

Document ids ``documents (B, T)`` (packed rows): the model gets each span's ids, so every
layer-local state restarts at a start inside the span, and the blocks' reads of a document
starting inside a span use their initial parameters. Where a span's first token starts a
document, the whole fast state restarts before the span; where a document starts later in a
span, the outer-loss levels restart (tick 0) before the next one. Documents declared on a grid
of multiples of ``w`` (``nested.ops.documents.on_grid``) never start inside a span: the model
runs without ids, the restarts before spans are all it needs. So a packed row equals its
documents run alone when they start at multiples of the shortest period ``w``, as the task
``tokens`` lays them out (its ``align``, set to the model's grid: ``nested.run.config.
document_grid``); elsewhere their periods count from the row's start.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nested.core import inner, probes
from nested.core.level import Level, LevelState
from nested.ops import documents, functions, loops


class Accumulated(NamedTuple):
    """Gradient accumulated since the last update, and tokens seen in the stream ``(B,)``."""

    accum: Any
    tick: jax.Array


def initial_state(level: Level, params: Any) -> LevelState:
    """The state of a model-level memory from its parameters with a leading batch dim."""
    batch = jax.tree.leaves(params)[0].shape[0]
    opt_state = jax.vmap(level.rule.transform.init)(params)
    cache = Accumulated(jax.tree.map(jnp.zeros_like, params), jnp.zeros((batch,), jnp.int32))
    return LevelState(params, opt_state, cache, level.name)


def _advance(level: Level, state: LevelState, grad: Any, tokens: int) -> LevelState:
    tick = state.cache.tick + tokens
    # A period of one span ends at every span: ticks stay multiples of the span (spans add it;
    # restarts, `consolidate` and the initial state leave multiples of every), so the update
    # is due in every row and nothing accumulates.
    every_span = level.every == tokens
    accum = grad if every_span else jax.tree.map(jnp.add, state.cache.accum, grad)
    mean = jax.tree.map(lambda a: a / level.every, accum)
    updates, opt_state = jax.vmap(level.rule.transform.update)(mean, state.opt_state, state.params)
    stepped = (optax.apply_updates(state.params, updates), opt_state)
    if every_span:
        (params, opt_state), accum = stepped, state.cache.accum
    else:
        due = tick % level.every == 0
        params, opt_state = inner.select_rows(due, stepped, (state.params, state.opt_state))
        accum = inner.select_rows(due, jax.tree.map(jnp.zeros_like, accum), accum)
    return state.replace(params=params, opt_state=opt_state, cache=Accumulated(accum, tick))


def consolidate(level: Level, state: LevelState) -> LevelState:
    """Apply now what the level accumulated since its last update, as if its period ended
    here: ``theta <- theta + rule(accum / n)`` with ``n = tick % every`` the tokens since then,
    per sequence (nothing where ``n = 0``); the accumulator restarts."""
    pending = state.cache.tick % level.every
    mean = jax.tree.map(
        lambda a: a / jnp.maximum(pending, 1).reshape((-1,) + (1,) * (a.ndim - 1)),
        state.cache.accum,
    )
    updates, opt_state = jax.vmap(level.rule.transform.update)(mean, state.opt_state, state.params)
    params, opt_state = inner.select_rows(
        pending > 0,
        (optax.apply_updates(state.params, updates), opt_state),
        (state.params, state.opt_state),
    )
    accum = jax.tree.map(jnp.zeros_like, state.cache.accum)
    tick = state.cache.tick - pending  # the next period starts here
    return state.replace(params=params, opt_state=opt_state, cache=Accumulated(accum, tick))


def _truncate(level: Level, state: LevelState) -> LevelState:
    if level.truncate is None:
        return state
    cut = state.cache.tick % level.truncate == 0
    return inner.select_rows(cut, jax.lax.stop_gradient(state), state)


def shortest_period(levels: dict[str, Level]) -> int:
    return min(level.every for level in levels.values())


def run(levels: dict[str, Level], model, inputs: jax.Array, fast, batch) -> tuple[Any, Any]:
    """Run ``model(inputs, fast) -> (logits, fast)`` span by span (the shortest period),
    stepping the outer-loss ``levels`` (name -> Level) after each span; ``batch`` holds the
    ``targets`` (and ``mask``) their objectives need, and optionally ``documents (B, T)``
    (module docstring). Returns ``(logits, fast)``."""
    w = shortest_period(levels)
    B, T = inputs.shape
    if T % w:
        name = min(levels.values(), key=lambda level: level.every).name
        raise ValueError(
            f"sequence length {T} is not a multiple of the period every={w} of level {name!r} "
            f"(the model runs period by period): use sequences whose length is a multiple of {w}"
        )
    names = ("targets", "mask", "documents")
    seqs = {"inputs": inputs, **{k: batch[k] for k in names if k in batch}}
    spans = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(B, T // w, w), 1, 0), seqs)
    objectives = list(dict.fromkeys(level.objective for level in levels.values()))
    is_state = lambda x: isinstance(x, LevelState)
    with_ids = "documents" in seqs
    if with_ids:
        # A span's first token starts a document: the whole fast state restarts before it.
        # A start later in a span: the outer-loss levels restart before the next span.
        starts = inner.document_starts(seqs["documents"]).reshape(B, T // w, w)
        later = jnp.any(starts[:, :, 1:], axis=2)
        later = jnp.concatenate([jnp.zeros_like(later[:, :1]), later[:, :-1]], axis=1)
        spans["first"], spans["later"] = jnp.moveaxis(starts[:, :, 0], 1, 0), later.T
        # One row of the initial state, broadcast inside each span: a restart reads one row,
        # and the transpose sums a span's restarting rows into it (not a (B, ...) carry).
        initial_row = model.initial_fast(1)

    def step(fast, span, packed: bool):
        if with_ids:
            fresh_fast = jax.tree.map(lambda a: functions.broadcast_rows(a[0], B), initial_row)
            fresh = jax.tree.flatten(fresh_fast, is_leaf=is_state)[0]
            fast = inner.select_rows(span["first"], fresh_fast, fast)
        leaves, treedef = jax.tree.flatten(fast, is_leaf=is_state)
        index = [i for i, x in enumerate(leaves) if isinstance(x, LevelState) and x.level in levels]
        for i in index:
            if with_ids:
                leaves[i] = inner.select_rows(span["later"], fresh[i], leaves[i])
            leaves[i] = _truncate(levels[leaves[i].level], leaves[i])

        def forward(memory_params):
            current = list(leaves)
            for i, params in zip(index, memory_params, strict=True):
                current[i] = current[i].replace(params=params)
            current = jax.tree.unflatten(treedef, current)
            if packed:
                return model(span["inputs"], current, documents=span["documents"])
            return model(span["inputs"], current)

        logits, pullback, new_fast = jax.vjp(
            forward, [leaves[i].params for i in index], has_aux=True
        )
        grads = [None] * len(index)
        for objective in objectives:
            seed = jax.grad(lambda lg, o=objective: jnp.sum(o(lg, span)))(logits)
            with jax.named_scope("cms_grads"):  # the span's backward pass to the memories
                (memory_grads,) = pullback(seed)
            for n, i in enumerate(index):
                level = levels[leaves[i].level]
                if level.objective == objective:
                    grad = memory_grads[n]
                    grads[n] = jax.lax.stop_gradient(grad) if level.first_order else grad
        new_leaves, _ = jax.tree.flatten(new_fast, is_leaf=is_state)
        for n, i in enumerate(index):
            new_leaves[i] = _advance(levels[new_leaves[i].level], new_leaves[i], grads[n], w)
        return jax.tree.unflatten(treedef, new_leaves), logits

    # Documents declared on a grid of multiples of w start only at spans' first tokens: the
    # restarts before spans are all the model needs; else it gets each span's ids.
    packed = with_ids and not documents.on_chunks(w)
    with (
        probes.repeated("the model runs period by period for outer-loss levels (a scan)"),
        documents.on_grid(math.gcd(documents.grid(), w)),  # the grid of a span's positions
    ):
        fast, logits = loops.remat_scan(partial(step, packed=packed), fast, spans)
    return jnp.moveaxis(logits, 0, 1).reshape(B, T, -1), fast
