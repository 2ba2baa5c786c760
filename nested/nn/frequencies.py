"""Memories of several update frequencies on the heads of one layer.

A :class:`~nested.nn.layers.MemoryLayer` whose heads are split among levels (a continuum of
memories inside one mixer, after the continuum memory system of Behrouz et al., "Nested
Learning", 2025): with ``n = len(head_levels)``, the first ``heads - n`` heads run ``level``
and head ``heads - n + i`` runs ``head_levels[i]`` (consecutive heads of one level form one
group, one :class:`~nested.core.level.LevelState`). Every head has the layer's projections,
convolution, gates and read-out, so the slow parameters and the carried bytes are those of the
same layer with one level: only the heads' update rules differ (their ``every``, their
``accumulate``, their ``persist``, a fixed step size). The levels share the memory (``d_k``,
``d_v``); a head level reads some or all of the first level's gates (one with a fixed step
size ignores the gate ``beta_t`` its heads are emitted).

Each group ``g`` writes ``(k_t, v_t)`` of its heads; with ``consolidate=True`` each slower group
instead writes what the group before it holds: its keys and its reads of them after the write,

    k'_t = k^(g-1)_t,    v'_t = f_{theta^(g-1)_t}(k^(g-1)_t),

so the slow memory learns to reproduce the fast one (a transfer between levels), at its own
period; it still reads with its own queries. Consecutive groups then have equal head counts.

Fast state: a tuple of the groups' states, fastest first; the layer's cache (convolution)
travels with the first. Document starts restart every group.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner
from nested.core.level import Level, LevelState
from nested.nn.layers import MemoryLayer, per_sequence


class MultiFrequencyMemory(MemoryLayer):
    """``MemoryLayer(level, ...)`` with heads of further levels ``head_levels`` (module
    docstring). ``x (B, T, dim) -> (y (B, T, dim), states)``."""

    def __init__(
        self,
        level: Level,
        *,
        head_levels: Sequence[Level] = (),
        consolidate: bool = False,
        dim: int,
        heads: int,
        rngs: nnx.Rngs,
        **layer_kwargs,
    ):
        if not head_levels:
            raise ValueError(
                "head_levels: name the levels of the other heads (model.head_levels); "
                "consolidate=True needs them"
            )
        if len(head_levels) >= heads:
            raise ValueError(
                f"head_levels: {len(head_levels)} levels, one head each, leave no head of "
                f"heads={heads} to level {level.name!r}; set model.heads to at least "
                f"{len(head_levels) + 1} or name fewer levels"
            )
        for other in head_levels:
            foreign = [n for n, g in other.gates.items() if level.gates.get(n) != g]
            if other.memory != level.memory or foreign:
                raise ValueError(
                    f"head_levels: level {other.name!r} must have the memory and gates of "
                    f"{level.name!r} (the heads share projections): use the same rule family"
                )
        if layer_kwargs.get("turn") is not None or layer_kwargs.get("experts", 1) > 1:
            raise ValueError("head_levels: MemT turns and experts take one level per layer")
        super().__init__(level, dim=dim, heads=heads, rngs=rngs, **layer_kwargs)
        per_head = [level] * (heads - len(head_levels)) + list(head_levels)
        groups = []  # (level, first head, heads)
        for h, head_level in enumerate(per_head):
            if groups and groups[-1][0] is head_level:
                groups[-1][2] += 1
            else:
                groups.append([head_level, h, 1])
        self.groups = tuple((lv, start, count) for lv, start, count in groups)
        if consolidate and len({count for _, _, count in self.groups}) > 1:
            raise ValueError(
                f"consolidate=True: each slower group writes the reads of the group before it, "
                f"so groups need equal head counts; got {[c for *_, c in self.groups]}"
            )
        self.consolidate = consolidate

    def initial_state(self, batch_size: int) -> tuple[LevelState, ...]:
        params = per_sequence(self.initial_params.get_value(), batch_size)
        cache = self.initial_cache(batch_size)
        return tuple(
            inner.initial_state(
                lv, jax.tree.map(lambda p, a=a, n=n: p[:, a : a + n], params), None if i else cache
            )
            for i, (lv, a, n) in enumerate(self.groups)
        )

    def __call__(self, x: jax.Array, states, starts=None):
        ctx, cache = self.context(x, states[0].cache, starts)
        reads, new_states, previous = [], [], None
        for i, ((lv, a, n), state) in enumerate(zip(self.groups, states, strict=True)):
            heads = lambda t, a=a, n=n: t[:, :, a : a + n]
            part = ctx._replace(
                k=heads(ctx.k),
                v=heads(ctx.v),
                q=heads(ctx.q),
                gates={name: heads(g) for name, g in ctx.gates.items()},
                initial=None if ctx.initial is None else ctx.initial[i],
            )
            if self.consolidate and previous is not None:
                prev_level, prev_state, prev_part = previous
                # the faster group runs a second time, reading its keys: its cost doubles
                recalled, _ = inner.run(prev_level, prev_state, prev_part._replace(q=prev_part.k))
                part = part._replace(k=prev_part.k, v=recalled)
            o, new = inner.run(lv, state, part)
            previous = (lv, state, part)
            reads.append(o)
            new_states.append(new if i else new.replace(cache=cache))
        o = jnp.concatenate(reads, axis=2)
        return self.readout(o, x), tuple(new_states)
