"""Recipes are declarations: equal ones compare equal (and share a compilation), and their
hyperparameters reach the level."""

import jax
import jax.numpy as jnp
import pytest
import tiny_configs

import nested as nl
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
