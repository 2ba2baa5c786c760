"""Numerical guards: non-finite values are reported with the step, level and quantity."""

import chex
import jax
import jax.numpy as jnp
import optax

import nested as nl
from nested.core import guards
from nested.nn.models import MemoryLM


def program(rule, skip=False):
    memory = nl.Level(
        "memory", memory=nl.memories.Linear(4, 4), objective=nl.objectives.l2, update=rule
    )

    def model(rngs):
        return MemoryLM(memory, vocab=11, dim=8, heads=2, layers=1, rngs=rngs)

    backbone = nl.Level(
        "backbone",
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.adam(1e-3),
        every="step",
    )
    system = nl.NestedSystem([backbone, memory], owners={"memory": "backbone"})
    return nl.compile(system, skip_nonfinite=skip)


BATCH = {"inputs": jnp.arange(24).reshape(2, 12) % 11, "targets": jnp.ones((2, 12), jnp.int32)}


def test_healthy_step_reports_every_quantity_finite():
    prog = program(optax.sgd(0.1))
    _, metrics = jax.jit(prog.train_step)(prog.init(jax.random.key(0)), BATCH)
    assert {k for k in metrics if k.startswith("finite/")} == {
        "finite/loss",
        "finite/grads",
        "finite/memory",
    }
    assert guards.failure(metrics, step=0) is None


def test_diverging_memory_is_named():
    prog = program(optax.sgd(1e38))  # the fast weights overflow float32
    _, metrics = jax.jit(prog.train_step)(prog.init(jax.random.key(0)), BATCH)
    assert not metrics["finite/memory"]
    message = guards.failure(metrics, step=7)
    assert message.startswith("step 7: non-finite values in ")
    assert "the fast state of level 'memory'" in message


def test_skip_nonfinite_keeps_the_previous_state():
    prog = program(optax.sgd(1e38), skip=True)
    state = prog.init(jax.random.key(0))
    new, metrics = jax.jit(prog.train_step)(state, BATCH)
    assert int(metrics["skipped"]) == 1
    assert int(new.step) == 1
    chex.assert_trees_all_equal(new.params, state.params)
