"""Plasticity capacity measures on hand-computed numbers and against the memories' own reads."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

from nested.learn import memories
from nested.plasticity import capacity
from nested.run import config as nc
from nested.run import pieces


def test_relative_change_of_a_known_pair():
    before = jnp.ones((2, 3, 4, 4))
    after = before * 1.5
    rel = capacity.relative_change(before, after)
    assert rel.shape == (2, 3)
    np.testing.assert_allclose(rel, 0.5, rtol=1e-12)
    # ||0.5 * ones(4, 4)||_F = 0.5 * 4.
    np.testing.assert_allclose(capacity.change_norm(before, after), 2.0, rtol=1e-12)


def test_relative_change_counts_all_layers_together():
    before = ({"w": jnp.full((2, 3, 1, 4), 2.0)}, {"w": jnp.zeros((2, 3, 5, 1))})
    after = ({"w": jnp.full((2, 3, 1, 4), 2.0)}, {"w": jnp.ones((2, 3, 5, 1))})
    # ||delta|| = sqrt(5), ||before|| = sqrt(4 * 4) = 4.
    np.testing.assert_allclose(capacity.change_norm(before, after), math.sqrt(5.0), rtol=1e-12)
    np.testing.assert_allclose(
        capacity.relative_change(before, after), math.sqrt(5.0) / 4.0, rtol=1e-12
    )
    one = jax.tree.map(lambda x: x[0, 0], (before, after))
    np.testing.assert_allclose(capacity.relative_change(*one, lead_dims=0), math.sqrt(5.0) / 4.0)


def test_relative_change_from_zero_is_huge_and_change_norm_is_not():
    before = ({"w": jnp.zeros((2, 3, 4))},)
    after = ({"w": jnp.full((2, 3, 4), 0.5)},)
    np.testing.assert_allclose(capacity.change_norm(before, after, lead_dims=1), math.sqrt(3.0))
    np.testing.assert_allclose(
        capacity.relative_change(before, after, lead_dims=1), math.sqrt(3.0) / 1e-12
    )


def test_change_norm_rejects_mismatched_leaves():
    with pytest.raises(ValueError, match="leaf shapes differ"):
        capacity.change_norm(jnp.ones((2, 3, 4, 4)), jnp.ones((2, 3, 4, 1)))


def test_singular_values_batched():
    m = jnp.broadcast_to(jnp.diag(jnp.array([1.0, 3.0])), (4, 2, 2))
    s = capacity.singular_values(m)
    assert s.shape == (4, 2)
    np.testing.assert_allclose(s, np.tile([3.0, 1.0], (4, 1)), rtol=1e-12)


def test_effective_rank_known_values():
    np.testing.assert_allclose(capacity.effective_rank(jnp.eye(5)), 5.0, rtol=1e-12)
    u, v = jnp.arange(1.0, 4.0), jnp.array([1.0, -2.0, 0.5, 4.0])
    np.testing.assert_allclose(capacity.effective_rank(jnp.outer(u, v)), 1.0, rtol=1e-9)
    # Singular values (3, 1): p = (0.75, 0.25).
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    erank = capacity.effective_rank(jnp.diag(jnp.array([3.0, 1.0])))
    np.testing.assert_allclose(erank, expected, rtol=1e-12)


def test_stable_rank_known_values():
    np.testing.assert_allclose(
        capacity.stable_rank(jnp.diag(jnp.array([2.0, 1.0]))), 5.0 / 4.0, rtol=1e-12
    )
    u, v = jnp.arange(1.0, 4.0), jnp.array([1.0, -2.0, 0.5, 4.0])
    np.testing.assert_allclose(capacity.stable_rank(jnp.outer(u, v)), 1.0, rtol=1e-9)
    np.testing.assert_allclose(capacity.stable_rank(jnp.eye(3)), 3.0, rtol=1e-12)


def test_ranks_are_batched_and_zero_matrix_gives_zero():
    w = jax.random.normal(jax.random.key(0), (2, 3, 4, 6))
    w = w.at[1, 2].set(0.0)
    s = np.linalg.svd(np.asarray(w), compute_uv=False)
    s[1, 2] = 1.0  # references for the live matrices; the zero matrix's convention set below
    p = s / s.sum(-1, keepdims=True)
    erank = np.exp(-np.sum(p * np.log(p), axis=-1))
    srank = np.sum(s * s, axis=-1) / s.max(-1) ** 2
    erank[1, 2] = srank[1, 2] = 0.0
    np.testing.assert_allclose(capacity.effective_rank(w), erank, rtol=1e-12)
    np.testing.assert_allclose(capacity.stable_rank(w), srank, rtol=1e-12)
    live = np.delete(np.stack([erank, srank]).reshape(2, -1), 5, axis=1)
    assert np.all((live >= 1.0) & (live <= 4.0))


def test_dormant_fraction_hand_made_layer():
    # Unit 0 is dead, unit 1 tiny (and negative: |h| counts), units 2 and 3 active.
    h = jnp.array(
        [
            [0.0, -1e-3, 1.0, 2.0],
            [0.0, 1e-3, -1.0, 2.0],
            [0.0, -1e-3, 1.0, -2.0],
        ]
    )
    # mean |h| = (0, 1e-3, 1, 2), layer mean 3.001 / 4: unit 1 scores 1.3e-3, unit 2 1.33.
    assert capacity.dormant_fraction(h) == 0.25
    assert capacity.dormant_fraction(h, tau=0.1) == 0.5
    assert capacity.dormant_fraction(h, tau=1.5) == 0.75


def test_dormant_fraction_all_zero_layer_and_batch_of_layers():
    zero = jnp.zeros((5, 3))
    assert capacity.dormant_fraction(zero) == 1.0  # 0/0 scores, no NaN
    assert capacity.dormant_fraction(zero, tau=0.1) == 1.0
    layers = jnp.stack([zero, jnp.ones((5, 3))])
    np.testing.assert_array_equal(jax.vmap(capacity.dormant_fraction)(layers), [1.0, 0.0])


KEYS = jax.random.normal(jax.random.key(1), (7, 4))


@pytest.mark.parametrize(
    "memory",
    [
        memories.MLP(d_k=4, d_v=3, hidden=5, depth=2, activation="gelu"),
        memories.MLP(d_k=4, d_v=3, hidden=6, depth=3, activation="relu"),
        memories.MLP(d_k=4, d_v=4, hidden=5, depth=2, activation="tanh", residual=True),
        memories.Featurized(memories.MLP(d_k=8, d_v=3, hidden=5, depth=3, activation="silu")),
    ],
)
def test_hidden_activations_reproduce_apply(memory):
    mlp = memory.memory if isinstance(memory, memories.Featurized) else memory

    @jax.jit  # one compile for the whole check: the test's time is XLA's compile time
    def read_both(key):
        params = memory.init(key)
        hidden = capacity.hidden_activations(memory, params, KEYS)
        last = jnp.einsum("...i,oi->...o", hidden[-1], params[-1]["w"])
        return (
            hidden,
            memories.mlp_output(KEYS, last, mlp.residual, 1e-6),
            memory.apply(params, KEYS),
        )

    hidden, rebuilt, read = read_both(jax.random.key(2))
    assert [h.shape for h in hidden] == [(7, mlp.hidden)] * (mlp.depth - 1)
    np.testing.assert_allclose(rebuilt, read, rtol=1e-12, atol=1e-12)


def test_dead_relu_unit_is_dormant():
    memory = memories.MLP(d_k=4, d_v=3, hidden=5, depth=2, activation="relu")

    @jax.jit
    def first_layer(key):
        params = memory.init(key)
        params = ({"w": params[0]["w"].at[0].set(0.0)}, params[1])
        (hidden,) = capacity.hidden_activations(memory, params, KEYS)
        return hidden

    hidden = first_layer(jax.random.key(3))
    assert np.all(hidden[:, 0] == 0.0)
    assert capacity.dormant_fraction(hidden) >= 0.2


@pytest.mark.parametrize(
    ("memory", "name"),
    [
        (memories.Linear(d_k=4, d_v=3), "Linear"),
        (memories.MLP(d_k=4, d_v=3, hidden=5, depth=1), "MLP(depth=1)"),
        (memories.Featurized(memories.Linear(d_k=8, d_v=3)), "Featurized(Linear)"),
    ],
)
def test_hidden_activations_need_a_hidden_layer(memory, name):
    params = memory.init(jax.random.key(0))
    message = f"memory {name} has no hidden units; dormant units are measured on MLP memories"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        capacity.hidden_activations(memory, params, KEYS)


def test_early_late_gap_numbers():
    out = capacity.early_late_gap(jnp.array([1.0, 2.0, 3.0, 5.0]))
    assert out == {"early": 1.5, "late": 4.0, "gap": 2.5, "per_phase": [1.0, 2.0, 3.0, 5.0]}
    sessions = jnp.array([[1.0, 3.0], [2.0, 2.0], [4.0, 6.0]])
    out = capacity.early_late_gap(sessions, early=1)
    assert out["per_phase"] == [2.0, 2.0, 5.0]
    assert (out["early"], out["late"], out["gap"]) == (2.0, 3.5, 1.5)
    assert capacity.early_late_gap(jnp.array([4.0, 1.0, 1.0]))["gap"] == -3.0


@pytest.mark.parametrize(
    ("losses", "early", "match"),
    [
        (jnp.array([1.0]), None, "P >= 2"),
        (jnp.zeros((2, 3, 4)), None, "P >= 2"),
        (jnp.array([1.0, 2.0, 3.0]), 0, r"early=0 must be in \[1, 2\]"),
        (jnp.array([1.0, 2.0, 3.0]), 3, r"early=3 must be in \[1, 2\]"),
    ],
)
def test_early_late_gap_errors(losses, early, match):
    with pytest.raises(ValueError, match=match):
        capacity.early_late_gap(losses, early=early)


def test_dormant_units_of_a_model_with_an_mlp_memory():
    """The whole path on a freshly built program (its first trace happens under the probe):
    one figure per hidden layer, none dormant at tau=0, all below a huge tau."""
    exp = nc.build(tiny_configs.config("continual", levels__memory__rule="ttt_mlp"))
    state = exp.program.init(jax.random.key(0), batch_size=4)
    batch = {k: v[0] for k, v in pieces.stacked_batches(exp.task, 0, 1, 4).items()}
    args = (exp.program, state.params, state.fast, batch)
    assert capacity.dormant_units(*args) == {"memory": [0.0]}  # depth 2: one hidden layer
    assert capacity.dormant_units(*args, tau=10.0) == {"memory": [1.0]}
