"""Sliding-window attention and the Titans hybrid mixers (memory as gate / as layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nested as nl
from nested.attention import SlidingWindowAttention, rotary
from nested.hybrid import MemoryAsGate, MemoryAsLayer

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
    y, _ = attn(x, attn.initial_state(2))
    np.testing.assert_allclose(y, naive(attn, x, window), rtol=1e-5, atol=1e-6)


def test_sliding_window_streams():
    attn = SlidingWindowAttention(dim=DIM, heads=HEADS, window=4, rngs=nnx.Rngs(0))
    x = x_of(11)
    whole, final = attn(x, attn.initial_state(2))
    a, mid = attn(x[:, :5], attn.initial_state(2))
    b, mid = attn(x[:, 5:6], mid)
    c, end = attn(x[:, 6:], mid)
    np.testing.assert_allclose(jnp.concatenate([a, b, c], 1), whole, rtol=1e-5, atol=1e-6)
    for u, w in zip(jax.tree.leaves(end), jax.tree.leaves(final), strict=True):
        np.testing.assert_allclose(u, w, rtol=1e-6)


@pytest.mark.parametrize("mixer_class", [MemoryAsGate, MemoryAsLayer])
def test_hybrid_mixers_stream(mixer_class):
    level = nl.recipes.delta(d_k=4, d_v=4)
    mixer = mixer_class(level, dim=DIM, heads=HEADS, window=3, rngs=nnx.Rngs(0))
    x = x_of(10)
    whole, final = mixer(x, mixer.initial_state(2))
    a, mid = mixer(x[:, :4], mixer.initial_state(2))
    b, end = mixer(x[:, 4:], mid)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), whole, rtol=1e-5, atol=1e-6)
    for u, w in zip(jax.tree.leaves(end), jax.tree.leaves(final), strict=True):
        np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-6)


def test_bad_attention_settings():
    with pytest.raises(ValueError, match="dim=9 is not divisible by heads=2"):
        SlidingWindowAttention(dim=9, heads=2, window=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="window=0 must be a positive"):
        SlidingWindowAttention(dim=8, heads=2, window=0, rngs=nnx.Rngs(0))


def test_adatransformer_reads_a_hebbian_memory_with_the_attention_output():
    from nested.attention import causal_attention
    from nested.hybrid import AdaTransformerMixer

    d = DIM // HEADS
    level = nl.recipes.hebbian(d_k=d, d_v=d)
    mixer = AdaTransformerMixer(level, dim=DIM, heads=HEADS, window=None, rngs=nnx.Rngs(0))
    mixer.initial_params.set_value({"W": jax.random.normal(jax.random.key(5), (HEADS, d, d))})
    x = x_of(7)
    y, state = mixer(x, mixer.initial_state(2))
    q, k, v = jnp.split(mixer.qkv(x).reshape(2, 7, 3 * HEADS, d), 3, axis=2)
    y_attn, _ = causal_attention(q, k, v, mixer.initial_state(2)["attention"], None)
    k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    M = mixer.initial_params.get_value()["W"][None, None] + jnp.cumsum(
        jnp.einsum("bthv,bthk->bthvk", v, k), axis=1
    )  # (B, T, H, d, d): M_t after the write
    expected = mixer.out(jnp.einsum("bthvk,bthk->bthv", M, y_attn).reshape(2, 7, DIM))
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state["memory"].params["W"], M[:, -1], rtol=1e-5, atol=1e-5)


def test_adatransformer_needs_head_sized_memory():
    from nested.hybrid import AdaTransformerMixer

    with pytest.raises(ValueError, match="AdaTransformer needs memory d_k == d_v == dim / heads"):
        AdaTransformerMixer(
            nl.recipes.hebbian(d_k=3, d_v=4), dim=DIM, heads=HEADS, window=None, rngs=nnx.Rngs(0)
        )
