"""Hope's self-modifying memory: projection updates, streaming, meta-gradients, an LM."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.hope import DIM, HEADS, C, hope_program

import nested as nl
from nested.nn.hope import SelfModifyingLayer


def make_layer(every=1, conv=4, lr_scale=None, memory=None):
    memory = memory or nl.recipes.delta(d_k=DIM // HEADS, d_v=DIM // HEADS, every=every)
    projections = nl.recipes.projections(d_k=DIM, d_v=DIM, every=C, lr_scale=lr_scale)
    return SelfModifyingLayer(
        memory, projections=projections, dim=DIM, heads=HEADS, conv=conv, rngs=nnx.Rngs(0)
    )


def x_of(T, seed=0):
    return jax.random.normal(jax.random.key(seed), (2, T, DIM), jnp.float32)


@pytest.mark.slow
def test_projections_change_once_per_chunk_by_the_self_generated_regression():
    layer = make_layer(conv=0, lr_scale=1.0)  # v_t = P_v x_t exactly; steps in (0, 1)
    x = x_of(C)
    state = layer.initial_state(2)
    _, after = layer(x, state)
    P = state["projections"].params[0]["w"]  # (B, 3, dim, dim)
    v = jnp.einsum("boi,bti->bto", P[:, 1], x)  # the chunk's values, chunk-start P_v
    lr = layer.projections.gates["beta"].activate(layer.projection_gates["beta"](x))  # (B, C, 3)
    targets = jnp.einsum("bpoi,bti->btpo", P, v)
    errors = jnp.einsum("bpoi,bti->btpo", P, x) - targets
    expected = P - jnp.einsum("btp,btpo,bti->bpoi", lr, errors, x)
    np.testing.assert_allclose(after["projections"].params[0]["w"], expected, rtol=1e-5, atol=1e-6)
    _, partial = layer(x[:, :3], state)  # within a chunk's first tokens: one update at the end
    assert jnp.any(partial["projections"].params[0]["w"] != P)


# The memory's state carries the convolution's last inputs, and an ATLAS memory's also its
# Omega window: both must survive the layer's chunks and the split between calls.
ATLAS = nl.recipes.atlas(
    d_k=DIM // HEADS, d_v=DIM // HEADS, window=3, degree=1, depth=1, ns_steps=0
)


@pytest.mark.parametrize("memory", [None, ATLAS], ids=["delta", "atlas"])
def test_streaming_at_chunk_boundaries(memory):
    layer = make_layer(memory=memory)
    x = x_of(3 * C + 2)
    call = jax.jit(lambda x, state: layer(x, state))  # (eagerly, every op compiles alone)
    whole, final = call(x, layer.initial_state(2))
    a, mid = call(x[:, : 2 * C], layer.initial_state(2))
    b, end = call(x[:, 2 * C :], mid)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), whole, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(end, final, rtol=1e-5, atol=1e-6)


def test_hope_lm_meta_gradient_of_the_initial_projections_equals_finite_differences():
    prog = hope_program()
    state = prog.init(jax.random.key(0))
    params = jax.tree.map(lambda p: p.astype(jnp.float64), state.params)
    x = jax.random.randint(jax.random.key(1), (2, 4 * C + 1), 0, 11)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    P0 = params["blocks"][0]["mixer"]["initial_projections"][...]

    def loss(P):
        p = jax.tree.map(lambda a: a, params)
        p["blocks"][0]["mixer"]["initial_projections"][...] = P
        return prog.loss(p, batch)[0]

    grad = jax.jit(jax.grad(loss))(P0)
    loss = jax.jit(loss)
    eps = 1e-6
    for index in [(0, 1, 2), (1, 0, 7), (2, 5, 5)]:
        e = jnp.zeros_like(P0).at[index].set(eps)
        fd = (loss(P0 + e) - loss(P0 - e)) / (2 * eps)
        assert grad[index] != 0
        np.testing.assert_allclose(grad[index], fd, rtol=1e-6, atol=1e-10)


@pytest.mark.slow
def test_hope_lm_trains():
    prog = hope_program()
    state = prog.init(jax.random.key(0))
    step = jax.jit(prog.train_step)
    x = jax.random.randint(jax.random.key(1), (4, 4 * C + 1), 0, 11)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.8 * losses[0], losses


# Documents of each row, off the chunk grid of C = 4: starts inside chunks, one on a chunk's
# first token (row 1), documents shorter than a chunk and spanning several.
DOCUMENTS = ((5, 9), (4, 2, 8), (3, 7, 4))


@pytest.mark.slow
@pytest.mark.parametrize("conv", [4, 0])
def test_packed_documents_off_the_chunk_grid_run_as_if_alone(conv):
    """A packed row equals its documents run alone, each from the initial state: outputs,
    the row's final state (the last document's, its unfinished period applied) and gradients
    with respect to every parameter and the inputs (float64), with the memory's own period
    (2) and the projections' (4) counted from each document's start."""
    layer = make_layer(every=2, conv=conv)
    graph, params = nnx.split(layer)
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    T = sum(DOCUMENTS[0])
    x = jax.random.normal(jax.random.key(1), (len(DOCUMENTS), T, DIM), jnp.float64)
    weights = jax.random.normal(jax.random.key(2), (len(DOCUMENTS), T, DIM), jnp.float64)
    documents = jnp.array([np.repeat(np.arange(len(r)), r) for r in DOCUMENTS], jnp.int32)
    wide = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float64), tree)

    def packed(params, x):
        layer = nnx.merge(graph, params)
        starts = nl.core.inner.document_starts(documents)
        return layer(x, wide(layer.initial_state(len(DOCUMENTS))), starts)

    def alone(params, x):
        layer = nnx.merge(graph, params)
        rows, finals = [], []
        for b, lengths in enumerate(DOCUMENTS):
            begins = np.cumsum((0, *lengths[:-1]))
            pieces = [
                layer(x[b : b + 1, a : a + n], wide(layer.initial_state(1)))
                for a, n in zip(begins, lengths, strict=True)
            ]
            rows.append(jnp.concatenate([y for y, _ in pieces], axis=1))
            finals.append(pieces[-1][1])
        return jnp.concatenate(rows), jax.tree.map(lambda *a: jnp.concatenate(a), *finals)

    @jax.jit
    def both(params, x):
        out = []
        for f in (packed, alone):
            y, final = f(params, x)
            grads = jax.grad(lambda p, x: jnp.sum(weights * f(p, x)[0]), argnums=(0, 1))(params, x)
            out.append((y, final, grads))
        return out

    (y, final, grads), (ref_y, ref_final, ref_grads) = both(params, x)
    np.testing.assert_allclose(y, ref_y, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(final, ref_final, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-9, atol=1e-11)
    # the projections learned in every document: the final ones are not the initial ones
    moved = final["projections"].params[0]["w"] - params["initial_projections"][...][None]
    assert float(jnp.min(jnp.abs(moved).max((1, 2, 3)))) > 1e-4
