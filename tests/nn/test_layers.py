"""Memory layers: streaming, Falcon's key alignment, MemT turns, Mixture-of-Storage."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nested as nl
from nested.core import inner
from nested.nn.layers import MemoryLayer, dense, per_sequence
from nested.ops import functions

DIM, HEADS = 8, 2


def layer(level=None, **kwargs):
    level = level or nl.recipes.delta(d_k=4, d_v=4)
    return MemoryLayer(level, dim=DIM, heads=HEADS, rngs=nnx.Rngs(0), **kwargs)


def inputs(T, seed=0):
    return jax.random.normal(jax.random.key(seed), (2, T, DIM))


def assert_close(a, b, rtol=1e-5):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"key_shift": True}, {"turn": 3}, {"conv": 0}])
def test_two_calls_with_carried_state_equal_one_call(kwargs):
    mixer = layer(**kwargs)
    x = inputs(12)
    call = jax.jit(lambda x, state: mixer(x, state))  # (eagerly, every op compiles alone)
    whole, final = call(x, mixer.initial_state(2))
    first, mid = call(x[:, :6], mixer.initial_state(2))
    second, end = call(x[:, 6:], mid)
    assert_close(jnp.concatenate([first, second], 1), whole)
    assert_close(end, final)


def test_key_shift_writes_the_previous_key_with_the_current_value():
    mixer = layer(key_shift=True, conv=0)
    plain = layer(conv=0)
    x = inputs(5)
    ctx, _ = mixer.context(x, mixer.initial_state(2).cache)
    ref, _ = plain.context(x, plain.initial_state(2).cache)
    np.testing.assert_allclose(ctx.k[:, 1:], ref.k[:, :-1])
    assert jnp.all(ctx.k[:, 0] == 0)
    np.testing.assert_allclose(ctx.v, ref.v)


@pytest.mark.slow
def test_turns_read_the_snapshot_from_the_start_of_the_turn():
    level = nl.recipes.delta(d_k=4, d_v=4)
    keys = jax.random.split(jax.random.key(0), 4)
    k = jax.random.normal(keys[0], (2, 7, HEADS, 4))
    ctx = inner.Context(
        k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        v=jax.random.normal(keys[1], (2, 7, HEADS, 4)),
        q=jax.random.normal(keys[2], (2, 7, HEADS, 4)),
        gates={"beta": jax.nn.sigmoid(jax.random.normal(keys[3], (2, 7, HEADS)))},
    )
    state = inner.initial_state(level, ({"w": jnp.zeros((2, HEADS, 4, 4))},))
    o, final = inner.run_turns(level, state, ctx, turn=3)
    _, reference_final = inner.run(level, state, ctx)
    np.testing.assert_allclose(final.params[0]["w"], reference_final.params[0]["w"], rtol=1e-12)
    for start in (0, 3, 6):  # turns [0, 3), [3, 6), [6, 7)
        if start == 0:
            W = state.params[0]["w"]
        else:
            W = inner.run(level, state, jax.tree.map(lambda a, s=start: a[:, :s], ctx))[1]
            W = W.params[0]["w"]
        expected = jnp.einsum("bhvk,bthk->bthv", W, ctx.q[:, start : start + 3])
        np.testing.assert_allclose(o[:, start : start + 3], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_mixture_of_storage_routed_to_one_expert_is_that_expert():
    level = nl.recipes.delta(d_k=4, d_v=4)
    mos = layer(level, experts=3, write_gate="beta", conv=0)
    single = layer(level, conv=0)
    # Copy the shared projections, give expert 0 the single layer's gates and initial state,
    # and route every write and read to expert 0.
    for name in ("qkv", "norm", "gate_out", "out"):
        setattr(mos, name, getattr(single, name))
    mos.gates["beta"].kernel[...] = jnp.repeat(single.gates["beta"].kernel[...], 3, axis=1)
    mos.gates["beta"].bias[...] = jnp.repeat(single.gates["beta"].bias[...], 3)
    init = single.initial_params.get_value()
    mos.initial_params.set_value(jax.tree.map(lambda p: jnp.repeat(p, 3, axis=0), init))
    mos.routes.kernel[...] = jnp.zeros_like(mos.routes.kernel[...])
    mos.routes.bias[...] = jnp.tile(jnp.array([60.0, 0.0, 0.0], jnp.float32), 2 * HEADS)
    x = inputs(6)
    y_mos, s_mos = mos(x, mos.initial_state(2))
    y_single, s_single = single(x, single.initial_state(2))
    np.testing.assert_allclose(y_mos, y_single, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        s_mos.params[0]["w"][:, ::3], s_single.params[0]["w"], rtol=1e-5, atol=1e-6
    )
    # Experts that receive no writes keep their initial state.
    np.testing.assert_allclose(s_mos.params[0]["w"][:, 1::3], 0.0, atol=1e-12)


def test_mixture_of_storage_needs_a_write_gate():
    with pytest.raises(ValueError, match="set write_gate to one of \\['beta'\\]"):
        layer(experts=2)


def test_per_sequence_broadcast_has_the_gradients_of_broadcast_to():
    """Its transpose sums rows as a product with ones (nested.ops.functions.broadcast_rows):
    first and second derivatives equal jnp.broadcast_to's, on a state past XLA's slow-reduce
    size (more than 32K elements a row)."""
    theta = {"w": jax.random.normal(jax.random.key(0), (4, 96, 96))}
    weights = jax.random.normal(jax.random.key(1), (5, 4, 96, 96))

    def loss(broadcast, theta):
        return jnp.sum(jnp.sin(broadcast(theta)["w"]) * weights)

    ours = lambda t: per_sequence(t, 5)
    plain = lambda t: jax.tree.map(lambda p: jnp.broadcast_to(p, (5, *p.shape)), t)
    assert ours(theta)["w"].shape == (5, 4, 96, 96)
    np.testing.assert_array_equal(ours(theta)["w"], plain(theta)["w"])
    first = lambda b: jax.grad(lambda t: loss(b, t))
    second = lambda b: jax.grad(lambda t: jnp.sum(jax.grad(loss, argnums=1)(b, t)["w"] ** 2))
    for derivative in (first, second):
        got, want = derivative(ours)(theta)["w"], derivative(plain)(theta)["w"]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16])
def test_dense_layers_have_the_values_and_gradients_of_nnx_linear(dtype):
    """``dense`` writes its product's gradients out (nested.ops.functions.dense_dot_general):
    values, first and second derivatives (in the input and the kernel) equal nnx.Linear's with
    lax.dot_general, on a batch of (2, 3) rows and a bias."""
    x = jax.random.normal(jax.random.key(1), (2, 3, 5))
    weights = jax.random.normal(jax.random.key(2), (2, 3, 7))
    layers = {
        "ours": dense(5, 7, dtype=dtype, rngs=nnx.Rngs(0)),
        "plain": nnx.Linear(5, 7, dtype=dtype, rngs=nnx.Rngs(0)),
    }
    graphdefs, states = zip(*(nnx.split(layer) for layer in layers.values()), strict=True)

    def loss(which, state, x):
        layer = nnx.merge(graphdefs[which], state)
        return jnp.sum(jnp.tanh(layer(x)).astype(jnp.float64) * weights)

    first = lambda which: jax.grad(lambda s, x: loss(which, s, x), argnums=(0, 1))
    squares = lambda tree: sum(jnp.sum(g.astype(jnp.float64) ** 2) for g in jax.tree.leaves(tree))
    second = lambda which: jax.grad(lambda s, x: squares(first(which)(s, x)), argnums=(0, 1))
    tolerance = 1e-12 if dtype == jnp.float64 else 2e-2
    ours, plain = layers.values()
    assert ours.dot_general is functions.dense_dot_general
    assert ours(x).dtype == plain(x).dtype == dtype
    np.testing.assert_allclose(ours(x), plain(x), rtol=tolerance, atol=tolerance)
    for derivative in (first, second):
        got, want = derivative(0)(states[0], x), derivative(1)(states[1], x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(
                a.astype(jnp.float64), b.astype(jnp.float64), rtol=tolerance, atol=tolerance
            )


def test_dense_dot_general_leaves_other_contractions_to_lax():
    a, b = jnp.ones((3, 4, 5)), jnp.arange(60.0).reshape(3, 5, 4)
    numbers = (((2,), (1,)), ((0,), (0,)))  # a batched product: not a dense layer's
    got = functions.dense_dot_general(a, b, numbers)
    np.testing.assert_array_equal(got, jax.lax.dot_general(a, b, numbers))
