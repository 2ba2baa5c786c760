"""Hybrid mixers: a fast-level memory combined with sliding-window attention (Titans).

Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time", use their neural memory in
three ways; two are here, each a token mixer ``mixer(x, state) -> (y, state)`` with state
``{"memory": LevelState, "attention": cache}``:

* :class:`MemoryAsGate` (MAG): two parallel branches on the same input, sliding-window
  attention ``a = SWA(x)`` (precise, short range) and the memory ``m = M(x)`` (long range),
  combined by a gate, ``y = a * sigmoid(m)``;
* :class:`MemoryAsLayer` (MAL): the memory first, attention on its output,
  ``y = SWA(x + M(x))``.

The memory branch is a :class:`nested.layers.MemoryLayer`, so any fast level (Titans, TTT,
DeltaNet...) can be the memory.
"""

from __future__ import annotations

import jax
from flax import nnx

from nested.attention import SlidingWindowAttention
from nested.layers import MemoryLayer
from nested.level import Level


class _Hybrid(nnx.Module):
    def __init__(
        self, level: Level, *, dim: int, heads: int, window: int, rngs: nnx.Rngs, **memory_kwargs
    ):
        self.memory = MemoryLayer(level, dim=dim, heads=heads, rngs=rngs, **memory_kwargs)
        self.attention = SlidingWindowAttention(dim=dim, heads=heads, window=window, rngs=rngs)

    def initial_state(self, batch_size: int) -> dict:
        return {
            "memory": self.memory.initial_state(batch_size),
            "attention": self.attention.initial_state(batch_size),
        }


class MemoryAsGate(_Hybrid):
    """Titans MAG: ``y = SWA(x) * sigmoid(M(x))``."""

    def __call__(self, x: jax.Array, state: dict) -> tuple[jax.Array, dict]:
        a, attention = self.attention(x, state["attention"])
        m, memory = self.memory(x, state["memory"])
        return a * jax.nn.sigmoid(m), {"memory": memory, "attention": attention}


class MemoryAsLayer(_Hybrid):
    """Titans MAL: ``y = SWA(x + M(x))``."""

    def __call__(self, x: jax.Array, state: dict) -> tuple[jax.Array, dict]:
        m, memory = self.memory(x, state["memory"])
        y, attention = self.attention(x + m, state["attention"])
        return y, {"memory": memory, "attention": attention}
