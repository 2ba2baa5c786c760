"""bfloat16 compute (``train.dtype``): the model computes in bfloat16, its parameters and every
fast state stay float32, and training follows the float32 run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

from nested import data
from nested.run import config as nc


def build(name, dtype, **more):
    exp = nc.build(tiny_configs.config(name, train__dtype=dtype, **more))
    batch_size = exp.config.train.batch_size
    state = exp.program.init(jax.random.key(0), batch_size=batch_size if exp.carries_fast else None)
    return exp, state


def dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


@pytest.mark.slow
def test_bfloat16_compute_keeps_parameters_and_fast_states_in_float32():
    exp, state = build("continual", "bfloat16")
    tokens = data.as_arrays(exp.task.batch(0, exp.config.train.batch_size))["inputs"]
    logits, fast = exp.program.apply(state.params, tokens, state.fast)
    assert logits.dtype == jnp.bfloat16  # the model computed in bfloat16
    assert dtypes(fast) == {"float32"}  # the fast states did not
    batch = data.as_arrays(exp.task.batch(0, exp.config.train.batch_size))
    state, metrics = jax.jit(exp.program.train_step)(state, batch)
    assert dtypes(state.params) == dtypes(state.fast) == {"float32"}
    assert bool(jnp.isfinite(metrics["loss"]))


def test_bfloat16_training_follows_float32_over_100_steps():
    """Losses of the same 100 steps of MQAR: bfloat16 keeps 8 bits of mantissa (relative
    rounding 2^-8 = 0.4% per operation); measured here, the losses differ by at most 0.01 on
    losses of 2.4-3.5. Tolerance: 0.03 (1% of the loss)."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        exp, state = build("mqar", dtype, train__steps=100)
        step, losses = jax.jit(exp.program.train_step), []
        for i in range(100):
            state, metrics = step(state, data.as_arrays(exp.task.batch(i, 4)))
            losses.append(float(metrics["loss"]))
        runs[dtype] = np.array(losses)
    np.testing.assert_allclose(runs["bfloat16"], runs["float32"], atol=0.03)
    assert runs["float32"][-1] < runs["float32"][0] - 0.5  # it trained: the check has teeth


def permutation_rows(vocab: int, batch: int, length: int, step: int) -> dict:
    """Rows that walk a fixed random permutation of the vocabulary from random first tokens:
    each next token is a function of the current one (a bigram table the slow weights learn)."""
    successor = np.random.default_rng(0).permutation(vocab)
    tokens = np.empty((batch, length + 1), np.int32)
    tokens[:, 0] = np.random.default_rng(step + 1).integers(0, vocab, batch)
    for t in range(length):
        tokens[:, t + 1] = successor[tokens[:, t]]
    rows = data.make_batch(tokens[:, :-1], tokens[:, 1:], np.ones((batch, length), np.float32))
    return data.as_arrays(rows)


@pytest.mark.slow
def test_bfloat16_language_model_follows_float32_over_50_steps():
    """configs/lm.py's tiny Titans (a neural memory: its fast state and the chunks' sums stay
    float32) trained 50 steps in bfloat16 and in float32 on the same batches of a permutation
    walk. Measured here: the losses differ by at most 0.0045 on losses from 5.9 down to 0.004
    (float32). Tolerance: 0.05."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        config = nc.load("configs/lm.py:titans-tiny")
        config.train.dtype = dtype
        exp = nc.build(config)
        state = exp.program.init(jax.random.key(0))
        step, losses = jax.jit(exp.program.train_step), []
        for i in range(50):
            batch = permutation_rows(exp.task.vocab_size, 8, exp.task.seq_len, i)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[dtype] = np.array(losses)
    np.testing.assert_allclose(runs["bfloat16"], runs["float32"], atol=0.05)
    assert runs["float32"][-1] < runs["float32"][0] - 5.0  # it trained: the check has teeth
