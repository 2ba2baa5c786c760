"""Recipes are declarations: equal ones compare equal (and share a compilation), and their
hyperparameters reach the level."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

import nested as nl
from nested.core import inner, kernels
from nested.run import config as nc


@pytest.mark.parametrize("rule", sorted(nl.recipes.named()))
def test_a_rebuilt_level_equals_the_first_and_hits_the_jit_cache(rule):
    build = lambda: nl.recipes.named()[rule](d_k=4, d_v=4, every=4)
    first, again = build(), build()
    assert first == again and hash(first) == hash(again)
    traces = []

    def gates(x, level):
        traces.append(level)
        return x + len(level.gates)

    jitted = jax.jit(gates, static_argnums=1)
    jitted(jnp.zeros(()), first)
    jitted(jnp.zeros(()), again)
    assert len(traces) == 1


def test_levels_that_differ_in_their_rule_differ():
    titans = nl.recipes.titans(d_k=4, d_v=4)
    assert titans != nl.recipes.titans(d_k=4, d_v=4, lr_scale=0.5)
    assert nl.rules.gradient_descent("lr", momentum="m") != nl.rules.gradient_descent("lr")


def test_titans_step_range_shrinks_with_the_chunk_and_is_configurable():
    gate = nl.recipes.titans(d_k=4, d_v=4, every=16).gates["lr"]  # default 0.1 / every
    assert (gate.scale, gate.init) == (0.00625, 0.003125)
    assert float(gate.activate(jnp.asarray(30.0))) == pytest.approx(0.00625)
    assert nl.recipes.titans(d_k=4, d_v=4).gates["lr"].scale == 0.1
    assert nl.recipes.titans(d_k=4, d_v=4, every=16, lr_scale=0.5).gates["lr"].scale == 0.5
    config = nc.load(f"{tiny_configs.path('char_lm')}:titans")
    config.levels.memory.lr_scale = 0.01  # --config.levels.memory.lr_scale=0.01
    assert nc.build(config).system["memory"].gates["lr"].scale == 0.01


def repeated_token_errors(clip, T=256, d=16, every=16):
    """|read - v| of a Titans memory (the kernel path) given one (key, value) T times, with
    momentum 0.99, the largest step of the recipe's range and decay 0.01."""
    level = nl.recipes.titans(d_k=d, d_v=d, every=every, clip=clip)
    assert inner.kernel_for(level).name == "neural_gradient_descent"
    params = jax.tree.map(lambda p: p[None, None], level.memory.init(jax.random.key(0)))
    state = inner.initial_state(level, params)
    k = jnp.ones((1, T, 1, d)) / jnp.sqrt(d)
    v = jax.random.normal(jax.random.key(1), (1, 1, 1, d)) * jnp.ones((1, T, 1, d))
    gate = lambda x: jnp.full((1, T, 1), x)
    gates = {"lr": gate(0.1 / every), "momentum": gate(0.99), "decay": gate(0.01)}
    o, _ = inner.run(level, state, inner.Context(k=k, v=v, q=k, gates=gates))
    return jnp.linalg.norm(o - v, axis=-1)[0, :, 0], float(jnp.linalg.norm(v[0, 0, 0]))


def test_a_clip_keeps_titans_bounded_on_a_long_run_of_one_token():
    """Every gradient of a chunk is the same and the momentum carries it on: unclipped, the
    memory diverges (reads off by 1e18 at token 95, after which the saturated memory reads 0);
    each token's gradient clipped to norm 1, every read stays within a few |v| of v."""
    errors, norm = repeated_token_errors(None)
    assert not np.all(np.isfinite(errors)) or float(errors.max()) > 1e3 * norm
    errors, norm = repeated_token_errors(1.0)
    assert np.all(np.isfinite(errors)) and float(errors.max()) < 5 * norm


def test_a_clip_is_a_positive_number_and_the_online_path_declines_it():
    with pytest.raises(ValueError, match="clip=-1.0 must be a positive number"):
        nl.rules.gradient_descent("lr", clip=-1.0)
    online = nl.recipes.titans(d_k=4, d_v=4, every=1, clip=1.0)
    kernel, reasons = kernels.find(online)
    assert kernel is None
    assert reasons["neural_gradient_descent"] == (
        "rule clips (clip=1.0) at every=1; the online path does not clip"
    )
    linear = dataclasses.replace(
        nl.recipes.delta(d_k=4, d_v=4), update=nl.rules.gradient_descent("beta", clip=1.0)
    )
    assert kernels.find(linear)[1]["delta_rule"] == (
        "rule clips its gradients (clip=1.0); this kernel does not"
    )
    config = nc.load(f"{tiny_configs.path('char_lm')}:titans")
    config.levels.memory.clip = 1.0  # --config.levels.memory.clip=1.0
    assert nc.build(config).system["memory"].rule.clip == 1.0
