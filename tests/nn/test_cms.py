"""Continuum Memory System: cadence, the update it makes, and exact meta-gradients."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tiny_configs

import nested as nl
from nested.nn.cms import ContinuumMemory
from nested.nn.models import MemoryLM
from nested.run import config as nc

VOCAB, DIM, PERIODS = 13, 8, (2, 4, 8)


def cms_levels(periods=PERIODS, lr=0.5):
    return [
        nl.Level(
            f"cms{c}",
            memory=nl.memories.MLP(DIM, DIM, 2 * DIM),
            objective=nl.objectives.outer_loss,
            update=optax.sgd(lr),
            every=c,
        )
        for c in periods
    ]


def program(cms):
    memory = nl.recipes.delta(d_k=4, d_v=4)

    def model(rngs):
        return MemoryLM(memory, vocab=VOCAB, dim=DIM, heads=2, layers=1, cms=cms, rngs=rngs)

    backbone = nl.Level(
        "backbone",
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.adam(1e-3),
        every="step",
    )
    owners = {level.name: "backbone" for level in [memory, *cms]}
    return nl.compile(nl.NestedSystem([backbone, memory, *cms], owners=owners))


def data(T, seed=0):
    x = jax.random.randint(jax.random.key(seed), (2, T + 1), 0, VOCAB)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def test_each_level_changes_exactly_at_multiples_of_its_period():
    prog = program(cms_levels())
    state = prog.init(jax.random.key(0))
    batch = data(16)
    fast = prog.start_fast(state.params, 2)
    apply = jax.jit(lambda p, x, y, f: prog.apply(p, x, f, targets=y))
    previous = [s.params for s in fast[0]["cms"]]
    for t in range(2, 17, 2):  # stream the sequence two tokens (one window) at a time
        _, fast = apply(
            state.params, batch["inputs"][:, t - 2 : t], batch["targets"][:, t - 2 : t], fast
        )
        current = [s.params for s in fast[0]["cms"]]
        for period, before, after in zip(PERIODS, previous, current, strict=True):
            changed = any(
                bool(jnp.any(a != b))
                for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
            )
            assert changed == (t % period == 0), (period, t)
        previous = current


def test_update_is_the_rule_on_the_mean_window_gradient():
    """One level, one period: theta_1 = theta_0 - lr * (1/C) grad sum_t l_t(theta_0)."""
    C, lr = 4, 0.5
    prog = program(cms_levels((C,), lr=lr))
    state = prog.init(jax.random.key(0))
    batch = data(C)
    start = prog.start_fast(state.params, 2)
    theta0 = start[0]["cms"][0].params

    @jax.jit  # one program (eagerly, every op compiles on its own: slower)
    def update_and_gradient(params, batch, start, theta0):
        _, fast = prog.apply(params, batch["inputs"], start, targets=batch["targets"])

        def window_loss(theta):
            f = (dict(start[0], cms=(start[0]["cms"][0].replace(params=theta),)),)
            logits, _ = prog.model(params)(batch["inputs"], f)
            return jnp.sum(nl.objectives.token_cross_entropy(logits, batch))

        return fast, jax.grad(window_loss)(theta0)

    fast, grad = update_and_gradient(state.params, batch, start, theta0)
    expected = jax.tree.map(lambda p, g: p - lr * g / C, theta0, grad)
    for a, b in zip(
        jax.tree.leaves(fast[0]["cms"][0].params), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_meta_gradients_reach_every_level_and_equal_finite_differences():
    prog = program(cms_levels())
    state = prog.init(jax.random.key(0))
    params = jax.tree.map(lambda p: p.astype(jnp.float64), state.params)
    batch = data(16)
    n = len(PERIODS)

    def loss(thetas):
        p = jax.tree.map(lambda a: a, params)
        for j, theta in enumerate(thetas):
            p["blocks"][0]["cms"]["initial_params"][j].set_value(theta)
        return prog.loss(p, batch)[0]

    thetas = [params["blocks"][0]["cms"]["initial_params"][j].get_value() for j in range(n)]
    grads = jax.jit(jax.grad(loss))(thetas)
    loss = jax.jit(loss)
    eps = 1e-6
    for j in range(n):
        for layer, index in [(0, (0, 0)), (1, (3, 5))]:
            assert grads[j][layer]["w"][index] != 0

            def moved(delta, j=j, layer=layer, index=index):
                out = [list(t) for t in thetas]
                out[j][layer] = {"w": out[j][layer]["w"].at[index].add(delta)}
                return [tuple(t) for t in out]

            fd = (loss(moved(eps)) - loss(moved(-eps))) / (2 * eps)
            np.testing.assert_allclose(grads[j][layer]["w"][index], fd, rtol=1e-6, atol=1e-10)


@pytest.mark.slow
def test_first_order_levels_take_their_window_gradients_as_constants():
    """Two windows of one level, written out: theta_1 = theta_0 - lr g / C with g the first
    window's gradient; the outer loss is the mean token loss of both windows. Exact: g
    depends on theta_0 (second order); first order: g is a constant."""
    C, lr = 4, 0.5
    batch = data(2 * C)
    windows = [jax.tree.map(lambda x, i=i: x[:, i * C : (i + 1) * C], batch) for i in range(2)]
    grads = {}
    for first_order in (False, True):
        level = dataclasses.replace(cms_levels((C,), lr=lr)[0], first_order=first_order)
        prog = program([level])
        params = jax.tree.map(lambda p: p.astype(jnp.float64), prog.init(jax.random.key(0)).params)
        theta0 = params["blocks"][0]["cms"]["initial_params"][0].get_value()

        def with_theta(theta, params=params):
            p = jax.tree.map(lambda a: a, params)
            p["blocks"][0]["cms"]["initial_params"][0].set_value(theta)
            return p

        def library(theta, prog=prog, with_theta=with_theta):
            return prog.loss(with_theta(theta), batch)[0]

        def written_out(theta, stop, prog=prog, with_theta=with_theta):
            p = with_theta(theta)
            model, start = prog.model(p), prog.start_fast(p, 2)

            def window_loss(theta_b, fast, window):
                fast = (dict(fast[0], cms=(fast[0]["cms"][0].replace(params=theta_b),)),)
                logits, fast = model(window["inputs"], fast)
                return jnp.sum(nl.objectives.token_cross_entropy(logits, window)), fast

            theta_b = start[0]["cms"][0].params  # theta0 for each sequence
            first, fast = window_loss(theta_b, start, windows[0])
            g = jax.grad(lambda t: window_loss(t, start, windows[0])[0])(theta_b)
            g = jax.lax.stop_gradient(g) if stop else g
            theta_1 = jax.tree.map(lambda t, g: t - lr * g / C, theta_b, g)
            second, _ = window_loss(theta_1, fast, windows[1])
            return (first + second) / (2 * 2 * C)

        got = jax.jit(jax.grad(library))(theta0)
        expected = jax.jit(jax.grad(lambda t, w=written_out, s=first_order: w(t, s)))(theta0)
        chex.assert_trees_all_close(got, expected, rtol=1e-9, atol=1e-12)
        grads[first_order] = got
    difference = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
        for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True)
    )
    assert difference > 1e-3  # the second-order term is there, and first order drops it


def test_first_order_is_for_window_levels_and_a_config_key():
    with pytest.raises(ValueError, match="first_order=True applies to levels that learn from"):
        nl.recipes.delta(d_k=4, d_v=4, first_order=True)
    with pytest.raises(ValueError, match="first_order=1 must be True or False"):
        dataclasses.replace(cms_levels((2,))[0], first_order=1)
    config = nc.load(f"{tiny_configs.path('char_lm')}:hope")
    config.levels.cms2.first_order = True
    levels = nc.build(config).system
    assert [levels[f"cms{i}"].first_order for i in (1, 2, 3)] == [False, True, False]


def test_sequence_length_must_be_a_multiple_of_the_window():
    prog = program(cms_levels())
    state = prog.init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match="sequence length 7 is not a multiple of the period every=2 of level 'cms2'",
    ):
        prog.loss(state.params, data(7))


def test_window_levels_take_no_gates():
    with pytest.raises(ValueError, match="level 'cms2': a level learning from the outer loss"):
        level = nl.Level(
            "cms2",
            memory=nl.memories.MLP(DIM, DIM, DIM),
            objective=nl.objectives.outer_loss,
            update=nl.rules.sgd("lr"),
            every=2,
        )
        outer = nl.Level(
            "backbone",
            memory=lambda rngs: None,
            objective=nl.objectives.next_token,
            update=optax.sgd(0.1),
            every="step",
        )
        nl.NestedSystem([outer, level], owners={"cms2": "backbone"})


class OneKeyMemory:
    """A memory written for one key at a time (``W @ k``): it cannot read a window's rows."""

    d_k = d_v = DIM

    def init(self, key):
        return {"W": jax.random.normal(key, (DIM, DIM))}

    def apply(self, params, k):
        return params["W"] @ k


def test_a_block_whose_memory_reads_one_key_at_a_time_is_refused():
    level = dataclasses.replace(cms_levels()[0], memory=OneKeyMemory())
    with pytest.raises(ValueError, match="level 'cms2': a CMS block reads a period's tokens"):
        ContinuumMemory([level], dim=DIM, rngs=nnx.Rngs(0))
    ContinuumMemory(cms_levels()[:1], dim=DIM, rngs=nnx.Rngs(0))  # the built-in MLP reads rows
