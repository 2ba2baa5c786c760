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
    keys = jax.random.split(jax.random.key(9), B * H)
    W0 = jax.tree.map(
        lambda p: 0.5 * p.reshape(B, H, *p.shape[1:]), jax.vmap(level.memory.init)(keys)
    )
    state = inner.initial_state(level, W0)
    # a non-zero momentum (or other optimizer state) at the start, where the rule has one
    state = state.replace(opt_state=jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), state.opt_state))

    def path(generic):
        def f(ctx, W0):
            o, final = inner.run(level, state.replace(params=W0), ctx, generic=generic)
            return o, (final.params, final.opt_state)

        return f

    fast, generic = path(False), path(True)
    for a, b in zip(jax.tree.leaves(fast(ctx, W0)), jax.tree.leaves(generic(ctx, W0)), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-11)

    def functional(f):
        def loss(ctx, W0):
            o, final = f(ctx, W0)
            return jnp.sum(jnp.sin(o)) + sum(jnp.sum(x**2) for x in jax.tree.leaves(final))

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


NEURAL = [
    ("ttt_linear", {"every": 4}),
    ("ttt_mlp", {"every": 4, "hidden": 5}),
    ("titans", {"depth": 1, "every": 1}),
    ("titans", {"depth": 2, "hidden": 5, "every": 4}),
    ("titans", {"depth": 2, "hidden": 5, "every": 4, "read": "chunk_start"}),
    ("atlas", {"window": 3, "degree": 2, "depth": 2, "hidden": 5, "ns_steps": 0, "every": 4}),
    ("atlas", {"window": 2, "degree": 1, "depth": 1, "ns_steps": 2, "every": 1}),
]


@pytest.mark.parametrize(("rule", "kwargs"), NEURAL)
def test_neural_rule_generic_path_equals_its_op(rule, kwargs):
    d = kwargs.pop("d", 3)
    compare(nl.recipes.RULES[rule](d_k=d, d_v=d, **kwargs), 11, rtol=1e-8)


def test_fast_forms_fall_back_where_the_op_does_not_apply():
    level = nl.recipes.gated_delta(d_k=DK, d_v=DV, read="chunk_start")
    ctx = context(level, 6)
    state = inner.initial_state(level, {"W": jnp.zeros((B, H, DV, DK))})
    a = inner.run(level, state, ctx)[0]
    b = inner.run(level, state, ctx, generic=True)[0]
    np.testing.assert_array_equal(a, b)
