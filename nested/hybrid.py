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

:class:`AdaTransformerMixer` is the example of the Nested Learning paper (seed 001): a
transformer block whose MLP ``y_attn W_MLP`` is replaced by a linear-attention memory read
``M_t y_attn`` with ``M_t = M_{t-1} + v_t k_t^T`` sharing the attention's keys and values and
a meta-learned initial state ``M_0``: the MLP weight moves from the outer level to an inner one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested import inner
from nested.attention import SlidingWindowAttention, causal_attention, initial_cache
from nested.layers import MemoryLayer, initial_memories, l2_normalize, per_sequence
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


class AdaTransformerMixer(nnx.Module):
    """Attention, then a fast memory in place of the MLP (AdaTransformer, seed 001).

    ``q, k, v = W_{q,k,v} x``; ``y_attn = Attn(q, k, v)`` (causal, optional window); the memory
    level (typically Hebbian, ``M_t = M_{t-1} + v_t k_t^T``) writes the attention's keys and
    values and is read with ``y_attn``: ``y = W_o M_t y_attn`` per head. The memory's
    ``d_k`` and ``d_v`` must equal the head dim.
    """

    def __init__(self, level: Level, *, dim: int, heads: int, window: int | None, rngs: nnx.Rngs):
        if dim % heads or level.memory.d_k != dim // heads or level.memory.d_v != dim // heads:
            raise ValueError(
                f"level {level.name!r}: AdaTransformer needs memory d_k == d_v == dim / heads = "
                f"{dim / heads:g}, got d_k={level.memory.d_k}, d_v={level.memory.d_v}"
            )
        self.level, self.heads, self.window = level, heads, window
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.gates = nnx.Dict(
            {
                name: nnx.Linear(
                    dim, heads, rngs=rngs, bias_init=nnx.initializers.constant(gate.bias())
                )
                for name, gate in level.gates.items()
            }
        )
        self.initial_params = initial_memories(level.memory, rngs.params(), heads)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

    def initial_state(self, batch_size: int) -> dict:
        params = per_sequence(self.initial_params.get_value(), batch_size)
        head_dim = self.level.memory.d_k
        return {
            "memory": inner.initial_state(self.level, params),
            "attention": initial_cache(batch_size, self.window, self.heads, head_dim),
        }

    def __call__(self, x: jax.Array, state: dict) -> tuple[jax.Array, dict]:
        B, T, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, -1), 3, axis=2)
        y_attn, attention = causal_attention(q, k, v, state["attention"], self.window)
        gates = {
            name: self.level.gates[name].activate(proj(x)) for name, proj in self.gates.items()
        }
        ctx = inner.Context(k=l2_normalize(k), v=v, q=y_attn, gates=gates)
        o, memory = inner.run(self.level, state["memory"], ctx)
        return self.out(o.reshape(B, T, -1)), {"memory": memory, "attention": attention}
