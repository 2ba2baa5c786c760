"""The compiled program: exact meta-gradients, streaming, persistence, and learning."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nested as nl
from nested import data as nl_data
from nested.data import MQARTask
from nested.nn.models import MemoryLM

VOCAB = 16


def program(level, *, dim=8, heads=2, layers=1, lr=1e-3, mlp_ratio=2, vocab=VOCAB):
    def model(rngs):
        return MemoryLM(
            level, vocab=vocab, dim=dim, heads=heads, layers=layers, mlp_ratio=mlp_ratio, rngs=rngs
        )

    backbone = nl.Level(
        "backbone",
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.adamw(lr),
        every="step",
    )
    system = nl.NestedSystem([backbone, level], owners={level.name: "backbone"})
    return nl.compile(system)


def tokens(B, T, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB)


def test_meta_gradient_equals_central_finite_differences():
    """d(outer loss)/d(inner learning-rate parameter, initial state), float64."""
    prog = program(nl.recipes.delta(d_k=4, d_v=4, every=1))
    state = prog.init(jax.random.key(0))
    params = jax.tree.map(lambda p: p.astype(jnp.float64), state.params)
    x = tokens(2, 11)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    mixer = params["blocks"][0]["mixer"]
    lr_bias = mixer["gates"]["beta"]["bias"][...]  # (heads,): the inner lr's parameter
    w0 = mixer["initial_params"].get_value()[0]["w"]  # (heads, d_v, d_k): the initial state
    w0 = w0 + 0.1 * jax.random.normal(jax.random.key(3), w0.shape)

    def outer_loss(lr_bias, w0):
        p = jax.tree.map(lambda a: a, params)
        p["blocks"][0]["mixer"]["gates"]["beta"]["bias"][...] = lr_bias
        p["blocks"][0]["mixer"]["initial_params"].set_value(({"w": w0},))
        return prog.loss(p, batch)[0]

    g_bias, g_w0 = jax.jit(jax.grad(outer_loss, argnums=(0, 1)))(lr_bias, w0)
    outer_loss = jax.jit(outer_loss)
    eps = 1e-6
    for h in range(2):
        e = jnp.zeros_like(lr_bias).at[h].set(eps)
        fd = (outer_loss(lr_bias + e, w0) - outer_loss(lr_bias - e, w0)) / (2 * eps)
        np.testing.assert_allclose(g_bias[h], fd, rtol=1e-6, atol=1e-10)
    for index in [(0, 0, 0), (1, 2, 3), (0, 3, 1)]:
        e = jnp.zeros_like(w0).at[index].set(eps)
        fd = (outer_loss(lr_bias, w0 + e) - outer_loss(lr_bias, w0 - e)) / (2 * eps)
        np.testing.assert_allclose(g_w0[index], fd, rtol=1e-6, atol=1e-10)
    assert jnp.all(g_bias != 0) and jnp.any(g_w0 != 0)


@pytest.mark.parametrize("every", [1, 4])
def test_streaming_one_sequence_in_two_calls_equals_one_call(every):
    prog = program(nl.recipes.delta(d_k=4, d_v=4, every=every))
    state = prog.init(jax.random.key(0))
    x = tokens(2, 12)
    apply = jax.jit(prog.apply)  # (eagerly, every op compiles on its own: slower)
    whole, final = apply(state.params, x)
    first, mid = apply(state.params, x[:, :8])
    second, end = apply(state.params, x[:, 8:], mid)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(end, final, rtol=1e-5, atol=1e-6)


def test_persist_stream_carries_fast_state_across_steps_and_sequence_resets():
    x = tokens(2, 9)
    batch = {"inputs": x, "targets": x}
    carried = {}
    for persist in ("sequence", "stream"):
        prog = program(nl.recipes.delta(d_k=4, d_v=4, persist=persist), lr=0.0)
        state = prog.init(jax.random.key(0), batch_size=2)
        step = jax.jit(prog.train_step)
        state, first = step(state, batch)
        _, second = step(state, batch)
        carried[persist] = (first["loss"], second["loss"], state.fast)
    # With lr=0 the slow weights do not move: a reset level repeats its loss exactly,
    # a carried one starts the second step from the first step's final memory.
    assert carried["sequence"][0] == carried["sequence"][1]
    assert carried["stream"][0] == carried["sequence"][0]
    assert carried["stream"][1] != carried["stream"][0]
    assert jnp.any(carried["stream"][2][0]["mixer"].params[0]["w"] != 0)


@pytest.mark.slow
def test_initial_state_of_a_carried_level_learns_from_the_rows_that_restart():
    """d(outer loss)/d(learned initial state) of a persist="stream" level, float64: a finite
    difference for a row that restarts (``reset``), exactly zero for a row that continues
    its carried state; and one training step moves the initial state."""
    memory = nl.recipes.delta(d_k=4, d_v=4, persist="stream")
    lm = lambda rngs: MemoryLM(memory, vocab=VOCAB, dim=8, heads=2, rngs=rngs)
    backbone = nl.Level(
        "backbone",
        memory=lm,
        objective=nl.objectives.next_token,
        update=optax.sgd(0.5),
        every="step",
    )
    prog = nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))
    state = prog.init(jax.random.key(0), batch_size=2)
    f64 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float64), tree)
    params = f64(state.params)
    x = tokens(2, 12)
    _, carried = prog.apply(params, x[:, :5])  # a carried state some tokens in
    inputs, targets = x[:, 5:-1], x[:, 6:]
    reset = jnp.zeros(inputs.shape, jnp.int32).at[0, 0].set(1)  # row 0: a new agent
    w0 = params["blocks"][0]["mixer"]["initial_params"].get_value()[0]["w"]
    w0 = w0 + 0.1 * jax.random.normal(jax.random.key(3), w0.shape, jnp.float64)

    def loss(w0, row):
        p = jax.tree.map(lambda a: a, params)
        p["blocks"][0]["mixer"]["initial_params"].set_value(({"w": w0},))
        mask = jnp.zeros(inputs.shape).at[row].set(1.0)
        batch = {"inputs": inputs, "targets": targets, "mask": mask, "reset": reset}
        return prog.stream_loss(p, batch, carried)[0]

    loss = jax.jit(loss, static_argnums=1)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    restarting, continuing = grad(w0, 0), grad(w0, 1)
    assert jnp.all(continuing == 0.0)
    assert jnp.all(jnp.abs(restarting[0]) > 0)
    eps = 1e-6
    for index in [(0, 0, 0), (1, 2, 3), (0, 3, 1)]:
        e = jnp.zeros_like(w0).at[index].set(eps)
        fd = (loss(w0 + e, 0) - loss(w0 - e, 0)) / (2 * eps)
        np.testing.assert_allclose(restarting[index], fd, rtol=1e-6, atol=1e-10)
        assert abs(fd) > 1e-6
    # Through the training step: the initial state moves by SGD on the restarting row's loss
    # (it stayed exactly in place when the start was built outside the gradient).
    batch = {"inputs": inputs, "targets": targets, "reset": reset}
    stepped, _ = jax.jit(prog.train_step)(state.replace(fast=carried), batch)
    before = state.params["blocks"][0]["mixer"]["initial_params"].get_value()[0]["w"]
    after = stepped.params["blocks"][0]["mixer"]["initial_params"].get_value()[0]["w"]
    assert float(jnp.max(jnp.abs(after - before))) > 1e-5


@pytest.mark.slow
def test_training_on_associative_recall_lifts_accuracy_far_above_chance():
    """A delta-rule LM learns in-context key -> value recall (MQAR, 4 pairs, vocab 64).
    (At lr 1e-2 it passes 0.85 query accuracy by step 200 for init seeds 0-3; at 3e-3 it took
    450 steps.)"""
    vocab = 64
    task = MQARTask(vocab_size=vocab, train_settings=((32, 4),), test_settings=((32, 4),))
    prog = program(
        nl.recipes.delta(d_k=16, d_v=16),
        dim=32,
        heads=2,
        layers=2,
        lr=1e-2,
        mlp_ratio=0,
        vocab=vocab,
    )
    state = prog.init(jax.random.key(0))
    step, evaluate = jax.jit(prog.train_step), jax.jit(prog.eval_step)
    test = task.batch(0, 256, split=task.eval_splits[0])
    before = evaluate(state, test)["accuracy"]
    for i in range(200):
        state, _ = step(state, task.batch(i, 32))
    after = evaluate(state, test)["accuracy"]
    chance = 1 / (vocab // 2)
    assert before < 3 * chance
    assert after > 0.75, f"query accuracy {after:.3f} after 200 steps (chance {chance:.3f})"


def test_a_batch_of_the_data_tasks_goes_in_as_it_is():
    """``nested.data.Batch`` (a pytree) goes into the jitted train_step, eval_step and loss."""
    prog = program(nl.recipes.delta(d_k=4, d_v=4))
    state = prog.init(jax.random.key(0))
    task = MQARTask(vocab_size=VOCAB, train_settings=((16, 2),), test_settings=((16, 2),))
    batch = task.batch(0, 2)
    arrays = {"inputs": batch.inputs, "targets": batch.targets, "mask": batch.mask}
    assert nl_data.as_arrays(batch).keys() == arrays.keys()
    _, metrics = jax.jit(prog.train_step)(state, batch)
    loss, _ = jax.jit(prog.loss)(state.params, batch)
    assert metrics["loss"] == loss == jax.jit(prog.eval_step)(state, arrays)["loss"]


def test_token_ids_outside_the_vocabulary_are_refused_where_the_batch_enters():
    """Values are checked where they are concrete (eager calls, ``check_batch``); under jit,
    shapes and dtypes are checked at trace time."""
    prog = program(nl.recipes.delta(d_k=4, d_v=4))
    state = prog.init(jax.random.key(0))
    x = tokens(2, 9)
    batch = {"inputs": x[:, :-1].at[1, 3].set(VOCAB), "targets": x[:, 1:]}
    outside = r"inputs holds token ids in \[\d+, 16\], outside \[0, 16\) \(the model's"
    for call in (
        lambda: prog.check_batch(batch),
        lambda: prog.train_step(state, batch),
        lambda: prog.eval_step(state, batch),
        lambda: prog.loss(state.params, batch),
        lambda: prog.apply(state.params, batch["inputs"]),
    ):
        with pytest.raises(ValueError, match=outside):
            call()
    with pytest.raises(ValueError, match=r"batch: targets holds token ids in \[-1, "):
        prog.check_batch({**batch, "inputs": x[:, :-1], "targets": x[:, 1:].at[0, 0].set(-1)})
    step = jax.jit(prog.train_step)
    with pytest.raises(ValueError, match="batch: inputs must hold integer token ids, got float"):
        step(state, {**batch, "inputs": batch["inputs"].astype(jnp.float32)})
    with pytest.raises(ValueError, match=r"batch: targets has shape \(2, 7\), inputs \(2, 8\)"):
        step(state, {**batch, "targets": x[:, 2:]})
    with pytest.raises(ValueError, match=r"batch has no 'targets'; .* got \['inputs'\]"):
        step(state, {"inputs": x})
    with pytest.raises(ValueError, match=r"batch: inputs has shape \(9,\); .* \(B, T\)"):
        step(state, {"inputs": x[0], "targets": x[0]})
