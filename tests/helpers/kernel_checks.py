"""A kernel against the generic path: random contexts and start states shaped by a level, and
the comparison of values and gradients (float64) of ``inner.run`` on both paths."""

import chex
import jax
import jax.numpy as jnp

from nested.core import inner

B, H = 2, 2


def context(level, T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3 + len(level.gates))
    k = jax.random.normal(keys[0], (B, T, H, level.memory.d_k))
    gates = {}
    for key, (name, gate) in zip(keys[3:], sorted(level.gates.items()), strict=True):
        size = () if gate.size is None else (getattr(level.memory, gate.size),)
        gates[name] = gate.activate(jax.random.normal(key, (B, T, H, *size)))
    return inner.Context(
        k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        v=jax.random.normal(keys[1], (B, T, H, level.memory.d_v)),
        q=jax.random.normal(keys[2], (B, T, H, level.memory.d_k)),
        gates=gates,
    )


def start_state(level):
    """Random initial memories, a non-zero momentum (or other rule state) where the rule has
    one, and a full window of earlier samples where the objective reads a window."""
    keys = jax.random.split(jax.random.key(9), B * H)
    W0 = jax.tree.map(
        lambda p: 0.5 * p.reshape(B, H, *p.shape[1:]), jax.vmap(level.memory.init)(keys)
    )
    state = inner.initial_state(level, W0)
    state = state.replace(opt_state=jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), state.opt_state))
    if state.cache is not None:
        earlier = context(level, inner.window_size(level) - 1, seed=5)
        window = {
            "k": jnp.moveaxis(earlier.k, 1, 2),
            "v": jnp.moveaxis(earlier.v, 1, 2),
            "gate": jnp.moveaxis(earlier.gates[level.objective.gate], 1, 2),
        }
        state = state.replace(cache={"window": window})
    return W0, state


def compare(level, T, path="kernel", rtol=1e-8, gradients=True):
    """``inner.run`` on ``path`` equals the generic path: outputs, final state (params, rule
    state, cache) and the gradients of a functional of both w.r.t. the context and theta_0."""
    ctx = context(level, T)
    W0, state = start_state(level)

    def outputs_and_gradient(path, ctx, W0, state):
        def f(ctx, W0):
            o, final = inner.run(level, state.replace(params=W0), ctx, path=path)
            return o, (final.params, final.opt_state, final.cache)

        if not gradients:
            return f(ctx, W0), None

        def loss(ctx, W0):
            o, final = f(ctx, W0)
            value = jnp.sum(jnp.sin(o)) + sum(jnp.sum(x**2) for x in jax.tree.leaves(final))
            return value, (o, final)

        grads, outputs = jax.grad(loss, argnums=(0, 1), has_aux=True)(ctx, W0)
        return outputs, grads

    # One program for both paths, values and gradients: compiling dominates these tests.
    both = jax.jit(lambda *a: [outputs_and_gradient(p, *a) for p in (path, "generic")])
    (fast, fast_grads), (generic, generic_grads) = both(ctx, W0, state)
    chex.assert_trees_all_close(fast, generic, rtol=rtol, atol=1e-11)
    if gradients:
        chex.assert_trees_all_close(fast_grads, generic_grads, rtol=rtol * 10, atol=1e-10)
