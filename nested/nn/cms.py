"""Continuum Memory System (Nested Learning, Behrouz et al. 2025): MLP blocks at many speeds.

A chain of residual MLP blocks, ``x <- x + MLP_{theta_j}(norm_j(x))`` for ``j = 1..K``, where
block ``j`` is a fast level updated every ``C_j`` tokens (``C_1 | C_2 | ... | C_K``) from the
gradients it accumulated over its period: the level's objective is the outer loss restricted
to the period (:class:`nested.objectives.OuterLoss`, dynamic evaluation; see
:mod:`nested.core.outer_loss`), its update rule any rule without per-token gates. Between
updates a block is a plain MLP; its initial parameters ``theta_j^0`` are slow parameters the
outer level meta-learns through every update. Document starts: see
:func:`nested.core.outer_loss.run` (the blocks restart at span boundaries) and
:meth:`ContinuumMemory.__call__`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner, outer_loss
from nested.core.level import Level, LevelState
from nested.nn.layers import initial_memories, per_sequence


def _reads_rows(memory, dim: int) -> bool:
    """Whether ``memory.apply`` maps keys (3, dim) to (3, dim), checked on shapes only."""
    params = jax.eval_shape(memory.init, jax.random.key(0))
    rows = jax.ShapeDtypeStruct((3, dim), jnp.float32)
    try:
        return jax.eval_shape(memory.apply, params, rows).shape == (3, dim)
    except (TypeError, ValueError):
        return False


class ContinuumMemory(nnx.Module):
    """CMS over ``x (B, T, dim)``: one block per level in ``levels`` (fastest first).

    Each level's memory must map ``dim -> dim`` (e.g. ``nested.memories.MLP(dim, dim,
    hidden)``) and its objective must be a :class:`nested.objectives.OuterLoss`.
    """

    def __init__(self, levels: Sequence[Level], *, dim: int, rngs: nnx.Rngs):
        for level in levels:
            if not level.learns_outer_loss:
                raise ValueError(
                    f"level {level.name!r}: a CMS block learns from the outer loss over its "
                    f"period; use objective=nested.objectives.outer_loss"
                )
            if (level.memory.d_k, level.memory.d_v) != (dim, dim):
                raise ValueError(
                    f"level {level.name!r}: memory maps {level.memory.d_k} -> "
                    f"{level.memory.d_v}, a CMS block of width {dim} needs {dim} -> {dim}"
                )
            if not _reads_rows(level.memory, dim):
                raise ValueError(
                    f"level {level.name!r}: a CMS block reads a period's tokens at once, so "
                    f"its memory's apply must map rows of keys (..., {dim}) -> (..., {dim}) "
                    "(the nested.memories.Memory protocol; the built-in memories do)"
                )
        self.levels = tuple(levels)
        self.norms = nnx.List([nnx.RMSNorm(dim, rngs=rngs) for _ in levels])
        self.initial_params = nnx.List(
            [initial_memories(level.memory, rngs.params(), None) for level in levels]
        )

    def initial_state(self, batch_size: int) -> tuple[LevelState, ...]:
        return tuple(
            outer_loss.initial_state(level, per_sequence(init.get_value(), batch_size))
            for level, init in zip(self.levels, self.initial_params, strict=True)
        )

    def __call__(
        self, x: jax.Array, states, starts=None
    ) -> tuple[jax.Array, tuple[LevelState, ...]]:
        """``x (B, T, dim)`` through the blocks at their current parameters; with document
        ``starts (B, T)``, the tokens of a document starting inside ``x`` read the blocks'
        initial parameters (no block updates inside a call)."""
        with jax.named_scope("cms"):
            return self._blocks(x, states, starts)

    def _blocks(self, x, states, starts):
        later = None if starts is None else inner.document_begins(starts)[:, :, None] > 0
        blocks = zip(self.levels, self.norms, states, self.initial_params, strict=True)
        for level, norm, state, initial in blocks:
            h = norm(x)
            read = jax.vmap(level.memory.apply)(state.params, h)  # per sequence
            if later is not None:
                read = jnp.where(
                    later, jax.vmap(level.memory.apply, (None, 0))(initial.get_value(), h), read
                )
            x = x + read.astype(x.dtype)
        return x, tuple(states)
