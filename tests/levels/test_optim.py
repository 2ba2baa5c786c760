"""Optimizers declared as levels equal the optax optimizers they are."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nested as nl
from nested.core import inner
from nested.levels import optim


def problem(seed=0):
    """A small least-squares problem with a matrix, a vector and a scalar parameter."""
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {"W": jax.random.normal(keys[0], (5, 3)), "b": jnp.zeros(5), "s": jnp.ones(())}
    x = jax.random.normal(keys[1], (16, 3))
    y = jax.random.normal(keys[2], (16, 5))

    def loss(p, i):
        xi, yi = x[i % 16], y[i % 16]
        return jnp.sum((p["s"] * (p["W"] @ xi) + p["b"] - yi) ** 2)

    return params, loss


def run(tx, steps=12):
    params, loss = problem()
    state = tx.init(params)
    trajectory = []
    for i in range(steps):
        grads = jax.grad(loss)(params, i)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        trajectory.append(params)
    return trajectory


def assert_same(a, b, rtol=1e-10):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=1e-12)


def test_momentum_level_is_heavy_ball_sgd():
    ours = run(optim.as_optimizer(optim.momentum(0.9), 0.05))
    theirs = run(optax.sgd(0.05, momentum=0.9))
    assert_same(ours, theirs)


def test_muon_level_is_optax_muon_on_matrices():
    params, loss = problem()
    matrix = {"W": params["W"]}
    steps = []
    for tx in (
        optim.as_optimizer(optim.muon(0.95), 0.02),
        optax.contrib.muon(0.02, beta=0.95, nesterov=False),
    ):
        p, state, out = matrix, tx.init(matrix), []
        for i in range(6):
            grads = jax.grad(lambda q, i=i: loss({**params, **q}, i))(p)
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
            out.append(p)
        steps.append(out)
    assert_same(steps[0], steps[1], rtol=1e-6)


def test_newton_schulz_pushes_singular_values_towards_one():
    x = jax.random.normal(jax.random.key(0), (8, 5))
    s = jnp.linalg.svd(nl.rules.newton_schulz(x, steps=5), compute_uv=False)
    assert jnp.all((s > 0.6) & (s < 1.3)), s
    u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    # same singular vectors: the update keeps the direction of x
    np.testing.assert_allclose(
        jnp.abs(jnp.sum((u @ vt) * nl.rules.newton_schulz(x, 5))) / 5, jnp.mean(s), rtol=1e-6
    )


@pytest.mark.slow
def test_deep_momentum_level_follows_its_definition():
    level = optim.deep_momentum(hidden=4, lr=0.1, beta=0.9)
    tx = optim.as_optimizer(level, 0.05, seed=3)
    params, loss = problem()
    state = tx.init(params)
    memories = {k: s.params for k, s in state.items()}
    mlp = lambda n: nl.memories.MLP(n, n, 4)
    ref = dict(params)
    for i in range(5):
        grads = jax.grad(loss)(params, i)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for name, g in jax.grad(loss)(ref, i).items():
            rows = g.reshape(-1, g.shape[-1] if g.ndim else 1)
            net = mlp(rows.shape[-1])
            read = lambda m, r, net=net: r + net.apply(m, r)
            objective = lambda m, rows=rows, read=read: (
                0.5 * sum(jnp.sum((read(m, r) - r) ** 2) for r in rows)
            )
            dm = jax.grad(objective)(memories[name])
            memories[name] = jax.tree.map(lambda m, d: 0.9 * m - 0.1 * d, memories[name], dm)
            step = jnp.stack([read(memories[name], r) for r in rows]).reshape(g.shape)
            ref[name] = ref[name] - 0.05 * step
        assert_same(params, ref, rtol=1e-9)
    assert any(jnp.any(w != 0) for w in jax.tree.leaves(memories))


def test_optimizer_level_as_a_fast_levels_rule():
    """A Linear memory stepped by the momentum level equals heavy-ball gradient descent."""
    as_level = nl.Level(
        "memory",
        memory=nl.memories.Linear(3, 2),
        objective=nl.objectives.l2,
        update=optim.as_rule(optim.momentum(0.8), learning_rate=0.3),
    )
    direct = nl.Level(
        "memory",
        memory=nl.memories.Linear(3, 2),
        objective=nl.objectives.l2,
        update=nl.rules.gradient_descent(0.3, momentum=0.8),
    )
    keys = jax.random.split(jax.random.key(1), 3)
    ctx = inner.Context(
        k=jax.random.normal(keys[0], (1, 9, 2, 3)),
        v=jax.random.normal(keys[1], (1, 9, 2, 2)),
        q=jax.random.normal(keys[2], (1, 9, 2, 3)),
        gates={},
    )
    W0 = ({"w": jnp.zeros((1, 2, 2, 3))},)
    o1, s1 = inner.run(as_level, inner.initial_state(as_level, W0), ctx)
    o2, s2 = inner.run(direct, inner.initial_state(direct, W0), ctx)
    np.testing.assert_allclose(o1, o2, rtol=1e-10)
    np.testing.assert_allclose(s1.params[0]["w"], s2.params[0]["w"], rtol=1e-10)


def test_gated_learning_rate_when_used_as_a_rule():
    rule = optim.as_rule(optim.momentum(0.5), learning_rate="lr")
    assert set(rule.gates) == {"lr"}


def test_optimizer_level_needs_a_shaped_memory():
    with pytest.raises(ValueError, match="level 'memory': an optimizer level's memory"):
        optim.as_optimizer(nl.recipes.delta(d_k=2, d_v=2), 0.1)
