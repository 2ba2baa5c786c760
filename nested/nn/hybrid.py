"""Hybrid mixers: a fast-level memory combined with sliding-window attention (Titans).

Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time", use their neural memory in
three ways, each a token mixer ``mixer(x, state, starts=None) -> (y, state)`` (``starts (B, T)``:
document starts, where every memory and attention restarts) with state
``{"memory": LevelState, "attention": cache}`` (MAC: ``{"memory": LevelState}``):

* :class:`MemoryAsContext` (MAC): the sequence in segments; each segment retrieves from the
  memory as it was before the segment, attends over persistent tokens, the retrieved tokens
  and itself, writes its attention output into the memory and is gated by the memory's read
  of it (equations in the class);
* :class:`MemoryAsGate` (MAG): two parallel branches on the same input, sliding-window
  attention ``a = SWA(x)`` (precise, short range) and the memory ``m = M(x)`` (long range),
  combined by a gate, ``y = a * sigmoid(m)``;
* :class:`MemoryAsLayer` (MAL): the memory first, attention on its output,
  ``y = SWA(x + M(x))``.

The memory branch is a :class:`nested.nn.layers.MemoryLayer`, so any fast level (Titans, TTT,
DeltaNet...) can be the memory.

:class:`AdaTransformerMixer` is the example of the Nested Learning paper (Behrouz et al.,
NeurIPS 2025): a transformer block whose MLP ``y_attn W_MLP`` is replaced by a linear-attention
memory read ``M_t y_attn`` with ``M_t = M_{t-1} + v_t k_t^T`` sharing the attention's keys and
values and a meta-learned initial state ``M_0``: the MLP weight moves from the outer level to an
inner one.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested.core import inner, probes
from nested.core.level import Level
from nested.nn.attention import (
    SlidingWindowAttention,
    attend,
    causal_attention,
    initial_cache,
    rotary,
)
from nested.nn.layers import MemoryLayer, dense, initial_memories, l2_normalize, per_sequence
from nested.ops import documents


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

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        a, attention = self.attention(x, state["attention"], starts)
        m, memory = self.memory(x, state["memory"], starts)
        return a * jax.nn.sigmoid(m), {"memory": memory, "attention": attention}


class MemoryAsLayer(_Hybrid):
    """Titans MAL: ``y = SWA(x + M(x))``."""

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        m, memory = self.memory(x, state["memory"], starts)
        y, attention = self.attention(x + m, state["attention"], starts)
        return y, {"memory": memory, "attention": attention}


class MemoryAsContext(nnx.Module):
    """Titans MAC: segments of ``window`` tokens read the memory as long-term context.

    For each segment ``x (C, dim)`` of the sequence, with the memory ``M`` as the previous
    segments left it (Titans section 4.1):

        h = M*(W_Q x)                    retrieval, no write: the memory's read of the queries
        y = Attn([P ; h ; x])            at the segment's positions; P: ``persistent`` learned
                                         tokens, visible to every position; token j sees h_i
                                         and x_i for i <= j only (h_i is a function of x_i)
        M, m = M(y)                      the memory level writes y (its keys and values of y)
                                         and reads each token after that token's write
        out = y * sigmoid(m)

    ``h`` and ``m`` are mapped to the model width by the memory layer's read-out (norm, gate,
    projection); the retrieval has its own query projection ``W_Q``. Attention is over the
    segment only (RoPE at positions within the segment; persistent keys carry no position):
    the long range is the memory's. A last shorter segment takes the rest of the sequence;
    calls split at multiples of ``window`` continue a stream exactly. The memory's period
    ``every`` must divide ``window`` so that each segment writes whole update chunks.

    Document ``starts (B, T)``: a segment whose first token starts a document begins from the
    memory's initial state; inside a segment, the tokens of a document starting there retrieve
    from the initial memory and attend within their document, and the memory restarts at the
    start. Segments stay ``window`` tokens from the row's start, so a packed row equals its
    documents run alone when they start at multiples of ``window``, as the task ``tokens``
    lays them out (its ``align``, set to the model's grid).
    """

    def __init__(
        self,
        level: Level,
        *,
        dim: int,
        heads: int,
        window: int | None,
        rngs: nnx.Rngs,
        persistent: int = 4,
        **memory_kwargs,
    ):
        if not isinstance(window, int) or window < 1:
            raise ValueError(
                f"memory as context: window={window!r} is the segment length and must be a "
                "positive number of tokens"
            )
        if window % level.every:
            raise ValueError(
                f"memory as context: level {level.name!r} updates every={level.every} tokens, "
                f"which does not divide the segment window={window}; use a window that is a "
                f"multiple of {level.every}"
            )
        if not isinstance(persistent, int) or persistent < 0:
            raise ValueError(f"memory as context: persistent={persistent!r} must be an int >= 0")
        self.window = window
        self.memory = MemoryLayer(level, dim=dim, heads=heads, rngs=rngs, **memory_kwargs)
        self.query = dense(dim, heads * level.memory.d_k, use_bias=False, rngs=rngs)
        self.attention = SlidingWindowAttention(dim=dim, heads=heads, window=None, rngs=rngs)
        tokens = jax.random.normal(rngs.params(), (persistent, dim), jnp.float32)
        self.persistent = nnx.Param(tokens * 0.02)

    def initial_state(self, batch_size: int) -> dict:
        return {"memory": self.memory.initial_state(batch_size)}

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        B, T, dim = x.shape
        # The persistent tokens' keys and values are the same in every segment.
        persistent = self.persistent[...].astype(x.dtype)
        _, keys, values = self._qkv(jnp.broadcast_to(persistent, (B, *persistent.shape)))
        segment = partial(self._segment, persistent=(keys, values))
        whole = T // self.window * self.window
        memory, outputs = state["memory"], []
        # Segments begin at multiples of the window: their documents' grid.
        with documents.on_grid(math.gcd(documents.grid(), self.window)):
            if whole:
                segments = jax.tree.map(
                    lambda a: jnp.moveaxis(
                        a[:, :whole].reshape(B, -1, self.window, *a.shape[2:]), 1, 0
                    ),
                    (x, starts),
                )
                with probes.repeated("memory-as-context segments (a scan over segments)"):
                    memory, y = jax.lax.scan(segment, memory, segments)
                outputs.append(jnp.moveaxis(y, 0, 1).reshape(B, whole, dim))
            if whole < T:
                memory, y = segment(memory, jax.tree.map(lambda a: a[:, whole:], (x, starts)))
                outputs.append(y)
        return jnp.concatenate(outputs, axis=1), {"memory": memory}

    def _qkv(self, tokens: jax.Array) -> list[jax.Array]:
        """Attention queries, keys, values of ``tokens (B, N, dim)``, each ``(B, N, H, d)``."""
        B, N, _ = tokens.shape
        qkv = self.attention.qkv(tokens).reshape(B, N, 3 * self.attention.heads, -1)
        return jnp.split(qkv, 3, axis=2)

    def _segment(self, memory, inputs, *, persistent):
        """One segment, ``inputs = (x (B, C, dim), starts (B, C) or None)``: ``(memory, out
        (B, C, dim))`` (class docstring); ``persistent``: the persistent tokens' keys and
        values, ``(B, n, H, d)`` each."""
        x, starts = inputs
        B, C, _ = x.shape
        q = self.query(x).reshape(B, C, self.attention.heads, -1)
        causal = np.arange(C)[:, None] >= np.arange(C)[None, :]
        if starts is None:
            h = self.memory.retrieve(memory.params, q, x)
            same = causal[None]
        else:
            initial = self.memory.initial_state(B)
            memory = inner.select_rows(starts[:, 0], initial, memory)
            starts = starts.at[:, 0].set(False)
            later = inner.document_begins(starts) > 0
            h = jnp.where(
                later[..., None],
                self.memory.retrieve(initial.params, q, x),
                self.memory.retrieve(memory.params, q, x),
            )
            document = jnp.cumsum(starts, axis=1)
            same = causal[None] & (document[:, :, None] == document[:, None, :])  # (B, C, C)
        rotate = lambda a: rotary(a, jnp.broadcast_to(jnp.arange(C), (B, C)))
        _, keys_h, values_h = self._qkv(h)
        queries, keys_x, values_x = self._qkv(x)
        keys = jnp.concatenate([persistent[0], rotate(keys_h), rotate(keys_x)], axis=1)
        values = jnp.concatenate([persistent[1], values_h, values_x], axis=1)
        visible = jnp.ones((same.shape[0], C, persistent[0].shape[1]), bool)
        allowed = jnp.concatenate([visible, same, same], axis=2)
        y = attend(rotate(queries), keys, values, allowed[:, None])
        y = self.attention.out(y.reshape(B, C, -1))
        m, memory = self.memory(y, memory, starts)
        return memory, y * jax.nn.sigmoid(m)


class AdaTransformerMixer(nnx.Module):
    """Attention, then a fast memory in place of the MLP (AdaTransformer, Nested Learning paper).

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
        self.qkv = dense(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.gates = nnx.Dict(
            {
                name: dense(dim, heads, rngs=rngs, bias_init=nnx.initializers.constant(gate.bias()))
                for name, gate in level.gates.items()
            }
        )
        self.initial_params = initial_memories(level.memory, rngs.params(), heads)
        self.out = dense(dim, dim, use_bias=False, rngs=rngs)

    def initial_state(self, batch_size: int) -> dict:
        params = per_sequence(self.initial_params.get_value(), batch_size)
        head_dim = self.level.memory.d_k
        return {
            "memory": inner.initial_state(self.level, params),
            "attention": initial_cache(batch_size, self.window, self.heads, head_dim),
        }

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        B, T, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, -1), 3, axis=2)
        y_attn, attention = causal_attention(q, k, v, state["attention"], self.window, starts)
        gates = {
            name: self.level.gates[name].activate(proj(x)) for name, proj in self.gates.items()
        }
        ctx = inner.Context(k=l2_normalize(k), v=v, q=y_attn, gates=gates)
        if starts is not None:
            ctx = ctx._replace(starts=starts, initial=self.initial_state(B)["memory"])
        o, memory = inner.run(self.level, state["memory"], ctx)
        o = o.reshape(B, T, -1).astype(x.dtype)
        return self.out(o), {"memory": memory, "attention": attention}
