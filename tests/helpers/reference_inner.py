"""The generic inner loop written as plain per-token loops from the equations, on random
contexts of fixed shapes ``(B, T, H, DK)`` keys and queries, ``(B, T, H, DV)`` values."""

import jax
import jax.numpy as jnp

from nested.core import inner

B, H, DK, DV = 2, 2, 3, 4


def make_context(T, seed=0, gates=("beta",)):
    keys = jax.random.split(jax.random.key(seed), 4 + len(gates))
    k = jax.random.normal(keys[0], (B, T, H, DK))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[1], (B, T, H, DV))
    q = jax.random.normal(keys[2], (B, T, H, DK))
    g = {
        name: jax.nn.sigmoid(jax.random.normal(key, (B, T, H)))
        for name, key in zip(gates, keys[4:], strict=True)
    }
    return inner.Context(k=k, v=v, q=q, gates=g)


def initial(level, seed=1):
    W0 = 0.3 * jax.random.normal(jax.random.key(seed), (B, H, DV, DK))
    return inner.initial_state(level, ({"w": W0},))


def reference(ctx, W0, every, step, read="after_write"):
    """Plain loop over tokens for each memory: gradients at the chunk start, ``step`` per token.

    ``step(W, S, k, v, W_chunk_start, gates) -> (W, S)``; the loop over tokens is written out,
    the memories (batch x heads) are vmapped.
    """
    T = ctx.k.shape[1]

    def one(W, k, v, q, gates):
        S, outs = jnp.zeros_like(W), []
        for t in range(T):
            if t % every == 0:
                W_start = W
            W, S = step(W, S, k[t], v[t], W_start, {n: g[t] for n, g in gates.items()})
            outs.append((W if read == "after_write" else W_start) @ q[t])
        return jnp.stack(outs), W

    heads_first = lambda x: jnp.moveaxis(x, 2, 1)  # (B, T, H, ...) -> (B, H, T, ...)
    args = jax.tree.map(heads_first, (ctx.k, ctx.v, ctx.q, ctx.gates))
    o, W = jax.vmap(jax.vmap(one))(W0, *args)
    return jnp.moveaxis(o, 1, 2), W


def delta_step(W, S, k, v, W_start, g):
    return W - g["beta"] * jnp.outer(W_start @ k - v, k), S
