"""Causal softmax attention with an optional sliding window (Flax NNX).

The attention branch of the Titans models (memory as a gate, memory as a layer) and of
AdaTransformer. Like the memory layers it is pure in its per-stream state:
``attention(x, cache) -> (y, cache)``. With a ``window`` of ``w`` tokens the cache keeps the
last ``w - 1`` keys and values and the stream position, so a sequence processed in pieces
gives the result of one call; without a window every call attends within itself only.
Positions are encoded with rotary embeddings (RoPE). With document ``starts (B, T)`` a token
attends within its own document only (RoPE is relative, so this equals the document alone); the
cache keeps where the current document began, so a later call does not reach back across it.

Beyond :data:`BLOCK` keys the scores are never held whole: :func:`attend_blockwise` runs
blocks of queries over the blocks of keys they can reach, with an online softmax (the
FlashAttention recurrence; Dao et al., "FlashAttention: Fast and Memory-Efficient Exact
Attention with IO-Awareness", arXiv:2205.14135), each block's mask computed from positions and
recomputed in the backward pass: memory grows as ``T x BLOCK`` instead of ``T x S``, work as
``T x (BLOCK + window)`` or, without a window, half the causal square.
``tests/nn/test_attention.py`` holds it equal to :func:`attend` in values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner
from nested.nn.layers import dense
from nested.ops import loops


def rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotate channel pairs of ``x (B, T, H, d)`` by angles ``positions (B, T) * base^(-2i/d)``
    (computed in float32 at least, in float64 for float64 ``x``)."""
    half = x.shape[-1] // 2
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    freqs = base ** (-jnp.arange(half, dtype=dtype) / half)
    angles = positions[..., None].astype(dtype) * freqs[None, None]  # (B, T, half)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return jnp.concatenate([rotated, x[..., 2 * half :]], axis=-1).astype(x.dtype)


def initial_cache(batch_size: int, window: int | None, heads: int, head_dim: int) -> dict:
    """Empty per-stream cache: the last ``window - 1`` keys and values, the position, and the
    position where the current document began (``begin``; keys before it are not attended)."""
    shape = (batch_size, (window or 1) - 1, heads, head_dim)
    return {
        "k": jnp.zeros(shape, jnp.float32),
        "v": jnp.zeros(shape, jnp.float32),
        "position": jnp.zeros((batch_size,), jnp.int32),
        "begin": jnp.zeros((batch_size,), jnp.int32),
    }


@jax.named_scope("attention")  # a part of lm_throughput --profile
def attend(q: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax attention ``y_t = sum_s softmax_s(q_t . k_s / sqrt(d)) v_s`` over the allowed keys.

    ``q (B, T, H, d)``, ``keys, values (B, S, H, d)``, ``allowed`` a boolean mask broadcasting
    to ``(B, H, T, S)``; every query needs at least one allowed key. Returns ``(B, T, H, d)``.
    """
    scores = jnp.einsum("bthd,bshd->bhts", q, keys) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), values)


BLOCK = 512  # queries and keys per block of attend_blockwise; longer calls take that path


@jax.named_scope("attention")
def attend_blockwise(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    allowed_of,
    *,
    past: int,
    window: int | None,
    block: int = BLOCK,
) -> jax.Array:
    """:func:`attend` by blocks of ``block`` queries and keys, never holding the scores whole.

    ``q (B, T, H, d)``, ``keys, values (B, S, H, d)``, query ``t`` being key ``past + t``;
    ``allowed_of(t0, j0) -> (B, block, block)`` bool: may queries ``t0 ..`` see keys
    ``j0 ..`` (queries past ``T`` are padding, keys past ``S`` must be refused). A query block
    visits only the key blocks that causality and the ``window`` let it reach (``window`` keys
    back: about ``1 + window / block`` blocks; without one, the blocks up to its diagonal).
    Over the visited blocks, running max ``m``, normaliser ``l`` and sum ``a`` per query:

        m' = max(m, max_s z_s),  l = l e^{m - m'} + sum_s e^{z_s - m'},
        a = a e^{m - m'} + sum_s e^{z_s - m'} v_s,          y = a / l,

    with ``z_s = q . k_s / sqrt(d)`` over the allowed keys. ``y`` does not depend on ``m``, so
    ``m`` is held constant for the gradient; each block is recomputed in the backward pass.
    """
    B, T, H, d = q.shape
    S = keys.shape[1]
    query_blocks, key_blocks = -(-T // block), -(-S // block)
    reach = key_blocks if window is None else -(-(block + window - 1) // block) + 1
    reach = min(reach, key_blocks)

    def blocked(x, count):  # (B, N, H, d) -> (count, B, block, H, d), zero padded
        x = jnp.pad(x, ((0, 0), (0, count * block - x.shape[1]), (0, 0), (0, 0)))
        return jnp.moveaxis(x.reshape(B, count, block, H, d), 1, 0)

    qs = blocked(q, query_blocks)
    ks, vs = blocked(keys, key_blocks + reach), blocked(values, key_blocks + reach)
    scale = 1.0 / jnp.sqrt(d).astype(q.dtype)
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    low = jnp.finfo(dtype).min

    def query_block(inputs):
        i, qi = inputs
        t0 = i * block
        lowest = 0 if window is None else jnp.maximum(t0 + past - window + 1, 0) // block
        last = t0 + block - 1 + past  # the last key a query of the block can see

        def visit(carry, r):
            j0 = (lowest + r) * block

            def update(carry):
                m, l, a = carry
                k, v = ks[lowest + r], vs[lowest + r]
                allowed = allowed_of(t0, j0)[:, None]  # (B, 1, block, block)
                z = jnp.einsum("bthd,bshd->bhts", qi, k).astype(dtype) * scale
                z = jnp.where(allowed, z, low)
                new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(z, axis=-1)))
                p = jnp.where(allowed, jnp.exp(z - new[..., None]), 0.0)
                decay = jnp.exp(m - new)
                l = l * decay + jnp.sum(p, axis=-1)
                a = a * jnp.moveaxis(decay, 1, 2)[..., None]
                a = a + jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v).astype(dtype)
                return new, l, a

            needed = (j0 <= last) & (j0 < S)
            return jax.lax.cond(needed, update, lambda carry: carry, carry), None

        start = (
            jnp.full((B, H, block), low, dtype),
            jnp.zeros((B, H, block), dtype),
            jnp.zeros((B, block, H, d), dtype),
        )
        (_, l, a), _ = loops.remat_scan(visit, start, jnp.arange(reach))
        l = jnp.where(l > 0, l, 1.0)  # padding queries (past T) may see nothing
        return a / jnp.moveaxis(l, 1, 2)[..., None]

    ys = jax.lax.map(query_block, (jnp.arange(query_blocks), qs))  # (blocks, B, block, H, d)
    y = jnp.moveaxis(ys, 0, 1).reshape(B, query_blocks * block, H, d)[:, :T]
    return y.astype(q.dtype)


def causal_attention(
    q, k, v, cache: dict, window: int | None, starts=None, block: int = BLOCK
) -> tuple[jax.Array, dict]:
    """Causal softmax attention of ``q, k, v (B, T, H, d)`` with RoPE and a sliding window.

    Token ``t`` attends to ``t - window + 1 .. t`` (every earlier token of the call when
    ``window`` is None), including the cached keys of the previous call, from the start of
    its document on (document ``starts (B, T)`` bool; the cache's ``begin`` before the first).
    More than ``block`` keys (cached and new) run blockwise (:func:`attend_blockwise`).
    Returns ``(y (B, T, H, d), cache)``.
    """
    T = q.shape[1]
    start = cache["position"]
    positions = start[:, None] + jnp.arange(T)[None]
    q, k = rotary(q, positions), rotary(k, positions)
    past = cache["k"].shape[1]
    keys = jnp.concatenate([cache["k"].astype(k.dtype), k], axis=1)
    values = jnp.concatenate([cache["v"].astype(v.dtype), v], axis=1)
    begin = jnp.broadcast_to(cache["begin"][:, None], positions.shape)  # (B, T)
    if starts is not None:
        within = inner.document_begins(starts)
        begin = jnp.where(within > 0, start[:, None] + within, begin)

    def allowed_of(t0, j0, queries, size):  # (B, queries, size): may query t0 + t see key j0 + s?
        at = jnp.minimum(t0 + jnp.arange(queries), T - 1)  # padding queries: as the last one
        query_positions, query_begin = positions[:, at], begin[:, at]
        key_positions = start[:, None] + j0 - past + jnp.arange(size)[None]
        offset = query_positions[:, :, None] - key_positions[:, None, :]
        allowed = (offset >= 0) & (key_positions[:, None, :] >= query_begin[:, :, None])
        allowed &= (j0 + jnp.arange(size) < past + T)[None, None]  # not padding
        return allowed if window is None else allowed & (offset < window)

    if past + T > block:
        y = attend_blockwise(
            q,
            keys,
            values,
            lambda t0, j0: allowed_of(t0, j0, block, block),
            past=past,
            window=window,
            block=block,
        )
    else:
        y = attend(q, keys, values, allowed_of(0, 0, T, past + T)[:, None])
    new_cache = {
        "k": keys[:, keys.shape[1] - past :].astype(cache["k"].dtype),
        "v": values[:, values.shape[1] - past :].astype(cache["v"].dtype),
        "position": start + T,
        "begin": begin[:, -1],
    }
    return y, new_cache


class SlidingWindowAttention(nnx.Module):
    """Multi-head causal attention; token ``t`` attends to tokens ``t - w + 1 .. t``.

    ``x (B, T, dim) -> (B, T, dim)``; ``window=None`` attends to every earlier token of the
    call. ``head_dim = dim // heads``.
    """

    def __init__(self, *, dim: int, heads: int, window: int | None, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"attention: dim={dim} is not divisible by heads={heads}")
        if window is not None and window < 1:
            raise ValueError(f"attention: window={window} must be a positive number of tokens")
        self.heads, self.window, self.head_dim = heads, window, dim // heads
        self.qkv = dense(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = dense(dim, dim, use_bias=False, rngs=rngs)

    def initial_state(self, batch_size: int) -> dict:
        return initial_cache(batch_size, self.window, self.heads, self.head_dim)

    @jax.named_scope("attention")
    def __call__(self, x: jax.Array, cache: dict, starts=None) -> tuple[jax.Array, dict]:
        B, T, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, self.head_dim), 3, axis=2)
        y, cache = causal_attention(q, k, v, cache, self.window, starts)
        return self.out(y.reshape(B, T, -1)), cache
