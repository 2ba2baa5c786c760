"""Every rule: its generic level path (objective + update rule stepped by the scheduler)
equals its fast form (the chunked op), values and gradients, float64, odd lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nested as nl
from nested import inner

B, H, DK, DV = 2, 2, 4, 3


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


def compare(level, T, rtol=1e-9):
    ctx = context(level, T)
    W0 = 0.3 * jax.random.normal(jax.random.key(9), (B, H, level.memory.d_v, level.memory.d_k))
    state = inner.initial_state(level, {"W": W0})

    def path(generic):
        def f(ctx, W0):
            o, final = inner.run(level, state.replace(params={"W": W0}), ctx, generic=generic)
            return o, final.params["W"]

        return f

    fast, generic = path(False), path(True)
    for a, b in zip(fast(ctx, W0), generic(ctx, W0), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-11)

    def functional(f):
        def loss(ctx, W0):
            o, W = f(ctx, W0)
            return jnp.sum(jnp.sin(o)) + jnp.sum(W**2)

        return jax.grad(loss, argnums=(0, 1))(ctx, W0)

    grads = [functional(fast), functional(generic)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol * 10, atol=1e-10)


LINEAR = ["hebbian", "delta", "gated_delta", "falcon", "gdn2"]


@pytest.mark.parametrize("rule", LINEAR)
@pytest.mark.parametrize(("T", "chunk"), [(13, None), (13, 4), (1, None)])
def test_linear_rule_generic_path_equals_its_op(rule, T, chunk):
    compare(nl.recipes.RULES[rule](d_k=DK, d_v=DV, chunk=chunk), T)


@pytest.mark.parametrize("every", [4, 5])
def test_minibatch_delta_is_ttt_linear(every):
    compare(nl.recipes.delta(d_k=DK, d_v=DV, every=every), 13)


def test_fast_forms_fall_back_where_the_op_does_not_apply():
    level = nl.recipes.gated_delta(d_k=DK, d_v=DV, read="chunk_start")
    ctx = context(level, 6)
    state = inner.initial_state(level, {"W": jnp.zeros((B, H, DV, DK))})
    a = inner.run(level, state, ctx)[0]
    b = inner.run(level, state, ctx, generic=True)[0]
    np.testing.assert_array_equal(a, b)
