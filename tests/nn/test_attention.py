"""Sliding-window attention and the Titans hybrid mixers (memory as gate / as layer)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nested as nl
from nested.nn.attention import SlidingWindowAttention, causal_attention, initial_cache, rotary
from nested.nn.hybrid import MemoryAsGate, MemoryAsLayer

DIM, HEADS = 8, 2


def x_of(T, seed=0):
    return jax.random.normal(jax.random.key(seed), (2, T, DIM), jnp.float32)


def naive(attn, x, window):
    """Per query position: softmax over the allowed earlier positions, written as a loop."""
    B, T, _ = x.shape
    d = DIM // HEADS
    q, k, v = jnp.split(attn.qkv(x).reshape(B, T, 3 * HEADS, d), 3, axis=2)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    q, k = rotary(q, pos), rotary(k, pos)
    rows = []
    for t in range(T):
        lo = 0 if window is None else max(0, t - window + 1)
        s = jnp.einsum("bhd,bshd->bhs", q[:, t], k[:, lo : t + 1]) / jnp.sqrt(d)
        rows.append(jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(s, -1), v[:, lo : t + 1]))
    return attn.out(jnp.stack(rows, 1).reshape(B, T, -1))


@pytest.mark.parametrize("window", [None, 1, 3])
def test_attention_equals_the_per_position_definition(window):
    attn = SlidingWindowAttention(dim=DIM, heads=HEADS, window=window, rngs=nnx.Rngs(0))
    x = x_of(9)
    # one program (eagerly, each slice length of the loop compiled its own ops)
    y, expected = jax.jit(lambda x: (attn(x, attn.initial_state(2))[0], naive(attn, x, window)))(x)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def assert_streams(layer, x, cuts):
    """``layer`` over ``x`` in pieces cut at ``cuts``, state carried, equals one call."""
    call = jax.jit(lambda x, state: layer(x, state))
    whole, final = call(x, layer.initial_state(x.shape[0]))
    state, pieces = layer.initial_state(x.shape[0]), []
    for start, stop in zip((0, *cuts), (*cuts, x.shape[1]), strict=True):
        y, state = call(x[:, start:stop], state)
        pieces.append(y)
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), whole, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state, final, rtol=1e-5, atol=1e-6)


def test_sliding_window_streams():
    attn = SlidingWindowAttention(dim=DIM, heads=HEADS, window=4, rngs=nnx.Rngs(0))
    assert_streams(attn, x_of(11), (5, 6))


@pytest.mark.parametrize("mixer_class", [MemoryAsGate, MemoryAsLayer])
def test_hybrid_mixers_stream(mixer_class):
    level = nl.recipes.delta(d_k=4, d_v=4)
    mixer = mixer_class(level, dim=DIM, heads=HEADS, window=3, rngs=nnx.Rngs(0))
    assert_streams(mixer, x_of(10), (4,))


def test_bad_attention_settings():
    with pytest.raises(ValueError, match="dim=9 is not divisible by heads=2"):
        SlidingWindowAttention(dim=9, heads=2, window=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="window=0 must be a positive"):
        SlidingWindowAttention(dim=8, heads=2, window=0, rngs=nnx.Rngs(0))


def test_adatransformer_reads_a_hebbian_memory_with_the_attention_output():
    from nested.nn.attention import causal_attention
    from nested.nn.hybrid import AdaTransformerMixer

    d = DIM // HEADS
    level = nl.recipes.hebbian(d_k=d, d_v=d)
    mixer = AdaTransformerMixer(level, dim=DIM, heads=HEADS, window=None, rngs=nnx.Rngs(0))
    mixer.initial_params.set_value(({"w": jax.random.normal(jax.random.key(5), (HEADS, d, d))},))
    x = x_of(7)
    y, state = mixer(x, mixer.initial_state(2))
    q, k, v = jnp.split(mixer.qkv(x).reshape(2, 7, 3 * HEADS, d), 3, axis=2)
    y_attn, _ = causal_attention(q, k, v, mixer.initial_state(2)["attention"], None)
    k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    M = mixer.initial_params.get_value()[0]["w"][None, None] + jnp.cumsum(
        jnp.einsum("bthv,bthk->bthvk", v, k), axis=1
    )  # (B, T, H, d, d): M_t after the write
    expected = mixer.out(jnp.einsum("bthvk,bthk->bthv", M, y_attn).reshape(2, 7, DIM))
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state["memory"].params[0]["w"], M[:, -1], rtol=1e-5, atol=1e-5)


def test_adatransformer_needs_head_sized_memory():
    from nested.nn.hybrid import AdaTransformerMixer

    with pytest.raises(ValueError, match="AdaTransformer needs memory d_k == d_v == dim / heads"):
        AdaTransformerMixer(
            nl.recipes.hebbian(d_k=3, d_v=4), dim=DIM, heads=HEADS, window=None, rngs=nnx.Rngs(0)
        )


def mac(window=4, persistent=3, every=2, **kwargs):
    from nested.nn.hybrid import MemoryAsContext

    level = nl.recipes.titans(d_k=4, d_v=4, hidden=8, every=every)
    return MemoryAsContext(
        level,
        dim=DIM,
        heads=HEADS,
        window=window,
        rngs=nnx.Rngs(0),
        persistent=persistent,
        **kwargs,
    )


def mac_by_segments(mixer, x, state):
    """Titans MAC written from its equations, one segment and one query position at a time:
    retrieve with the segment-start memory, attend over [P; h_0..h_j; x_0..x_j], write y."""
    from nested.core import inner

    B, T, _ = x.shape
    d = DIM // HEADS
    memory, persistent, outputs = state["memory"], mixer.persistent[...].astype(x.dtype), []
    for start in range(0, T, mixer.window):
        xs = x[:, start : start + mixer.window]
        C = xs.shape[1]
        q = l2n(mixer.query(xs).reshape(B, C, HEADS, d))
        h = mixer.memory.readout(inner.read(mixer.memory.level, memory.params, q), xs)
        proj = lambda t: jnp.split(mixer.attention.qkv(t).reshape(B, -1, 3 * HEADS, d), 3, axis=2)
        qp, kp, vp = proj(jnp.broadcast_to(persistent, (B, *persistent.shape)))
        qh, kh, vh = proj(h)
        qx, kx, vx = proj(xs)
        pos = jnp.broadcast_to(jnp.arange(C), (B, C))
        qx, kh, kx = rotary(qx, pos), rotary(kh, pos), rotary(kx, pos)
        rows = []
        for j in range(C):
            keys = jnp.concatenate([kp, kh[:, : j + 1], kx[:, : j + 1]], axis=1)
            values = jnp.concatenate([vp, vh[:, : j + 1], vx[:, : j + 1]], axis=1)
            s = jnp.einsum("bhd,bshd->bhs", qx[:, j], keys) / jnp.sqrt(d)
            rows.append(jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(s, -1), values))
        y = mixer.attention.out(jnp.stack(rows, 1).reshape(B, C, DIM))
        m, memory = mixer.memory(y, memory)
        outputs.append(y * jax.nn.sigmoid(m))
    return jnp.concatenate(outputs, 1), {"memory": memory}


def l2n(a):
    return a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)


@pytest.mark.slow
def test_memory_as_context_equals_its_per_segment_definition_values_and_gradients():
    """11 tokens in segments of 4 (the last one shorter), the Titans memory in chunks of 2."""
    mixer = mac()
    x = x_of(11).astype(jnp.float64)
    state = mixer.initial_state(2)
    y_shape, final_shape = jax.eval_shape(mixer, x, state)
    weights = jax.random.normal(jax.random.key(3), y_shape.shape, jnp.float64)
    # the gradient of sum(y * weights) w.r.t. x: the VJP of (weights, 0)
    cotangent = (weights, jax.tree.map(jnp.zeros_like, final_shape))

    @jax.jit  # one program for both, values and gradients: compiling dominates here
    def values_and_gradients(x):
        results = []
        for f in (mixer, lambda x, s: mac_by_segments(mixer, x, s)):
            out, pullback = jax.vjp(lambda x, f=f: f(x, state), x)
            results.append((out, pullback(cotangent)[0]))
        return results

    ((y, final), grad), ((expected, expected_final), expected_grad) = values_and_gradients(x)
    np.testing.assert_allclose(y, expected, rtol=1e-9, atol=1e-12)
    chex.assert_trees_all_close(final, expected_final, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.slow
def test_memory_as_context_is_causal_and_reads_the_memory_across_segments():
    mixer = mac()
    x = x_of(11).astype(jnp.float64)
    state = mixer.initial_state(2)
    jac = jax.jit(jax.jacobian(lambda x: mixer(x, state)[0][0, :, 0]))(x)[:, 0]  # (T, T, dim)
    reaches = np.abs(np.asarray(jac)).sum(-1) > 0
    np.testing.assert_array_equal(reaches, np.tril(np.ones((11, 11), bool)))
    # token 9 (third segment) depends on token 1 (first) only through the memory: with the
    # memory's writes switched off (zero step size) that dependence vanishes.
    no_writes = mac()
    for proj in no_writes.memory.gates.values():
        proj.bias.set_value(jnp.full_like(proj.bias[...], -1e3))
    frozen = jax.jit(jax.grad(lambda x: no_writes(x, state)[0][0, 9, 0]))(x)[0, 1]
    assert np.abs(np.asarray(jac[9, 1])).sum() > 1e-6
    np.testing.assert_allclose(frozen, 0.0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("memory_kwargs", [{}, {"experts": 2, "write_gate": "lr"}])
def test_memory_as_context_streams_at_segment_boundaries(memory_kwargs):
    """Also with Mixture-of-Storage memories: the retrieval reads every expert and routes."""
    assert_streams(mac(**memory_kwargs), x_of(14), (4, 12))


def test_bad_memory_as_context_settings():
    from nested.nn.models import make_mixer

    with pytest.raises(ValueError, match="every=2 tokens, which does not divide the segment "):
        mac(window=5)
    with pytest.raises(ValueError, match="window=None is the segment length"):
        mac(window=None)
    with pytest.raises(ValueError, match="persistent=-1 must be an int >= 0"):
        mac(persistent=-1)
    level = nl.recipes.delta(d_k=4, d_v=4)
    with pytest.raises(ValueError, match="persistent tokens of mixer='context'"):
        make_mixer("gate", level, dim=DIM, heads=HEADS, window=4, rngs=nnx.Rngs(0), persistent=2)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("documents", [pytest.param(False, marks=pytest.mark.slow), True])
def test_blockwise_attention_equals_the_whole_scores_values_and_gradients(window, documents):
    """Blocks of 8 keys over 37 queries and the cache's keys (not a multiple of 8), against the
    path that holds every score (itself held to the per-position definition above)."""
    B, T, H, d = 2, 37, 2, 4
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v = (jax.random.normal(key, (B, T, H, d), jnp.float32) for key in keys[:3])
    cache = initial_cache(B, window, H, d)
    if window is not None:  # a cache of a previous call: 4 keys back, document from position 3
        past = jax.random.normal(keys[3], cache["k"].shape)
        cache = {
            **cache,
            "k": past,
            "v": -past,
            "position": jnp.full((B,), 7),
            "begin": jnp.full((B,), 3),
        }
    starts = None
    if documents:
        starts = jnp.zeros((B, T), bool).at[0, 11].set(True).at[1, 20].set(True)

    def run(block, q, k, v):
        return causal_attention(q, k, v, cache, window, starts, block=block)

    whole, whole_cache = run(10**6, q, k, v)
    blocks, blocks_cache = run(8, q, k, v)
    np.testing.assert_allclose(blocks, whole, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(blocks_cache, whole_cache)
    weights = jax.random.normal(jax.random.key(5), whole.shape)
    loss = lambda block: lambda *qkv: jnp.sum(run(block, *qkv)[0] * weights)
    expected = jax.grad(loss(10**6), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(loss(8), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
