"""Hebbian, delta, gated delta and TTT-Linear ops against per-token references (float64).

Every chunk size (1 = per-token scan, 4 and 16 = chunked with padding, None = default) must give
the equation's per-token loop (``reference_linear``) in value and in the gradients w.r.t. every
input and the initial state, on lengths that are not multiples of the chunk.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_linear as ref
from helpers.reference_linear import assert_tree_close, make_inputs

from nested import ops

CASES = {
    "linear_attention": (
        lambda a, c: ops.linear_attention(
            a["q"], a["k"], a["v"], initial_state=a["state"], chunk_size=c, scale=0.5
        ),
        lambda a: ref.hebbian(a["q"], a["k"], a["v"], a["state"], scale=0.5),
        ("q", "k", "v", "state"),
    ),
    "delta_rule": (
        lambda a, c: ops.delta_rule(
            a["q"], a["k"], a["v"], a["beta"], initial_state=a["state"], chunk_size=c, scale=0.7
        ),
        lambda a: ref.delta(a["q"], a["k"], a["v"], a["beta"], a["state"], scale=0.7),
        ("q", "k", "v", "beta", "state"),
    ),
    "gated_delta_rule": (
        lambda a, c: ops.gated_delta_rule(
            a["q"], a["k"], a["v"], a["beta"], a["alpha"], initial_state=a["state"], chunk_size=c
        ),
        lambda a: ref.gated_delta(a["q"], a["k"], a["v"], a["beta"], a["alpha"], a["state"]),
        ("q", "k", "v", "beta", "alpha", "state"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_reference(name):
    ref.check_against_reference(*CASES[name])


def test_ttt_linear_matches_minibatch_reference():
    names = ("q", "k", "v", "lr", "state")
    for chunk in (4, 16):  # chunk_size=1 is checked against delta_rule below
        op = lambda a, c, chunk=chunk: ops.ttt_linear(
            a["q"], a["k"], a["v"], a["lr"], initial_state=a["state"], chunk_size=chunk
        )
        reference = lambda a, chunk=chunk: ref.ttt_linear(
            a["q"], a["k"], a["v"], a["lr"], a["state"], chunk
        )
        ref.check_against_reference(op, reference, names, ((7, (chunk,)), (37, (chunk,))))


@jax.jit
def _ttt_properties(a):
    ttt = lambda c: ops.ttt_linear(
        a["q"], a["k"], a["v"], a["lr"], initial_state=a["state"], chunk_size=c
    )
    delta = ops.delta_rule(a["q"], a["k"], a["v"], a["lr"], initial_state=a["state"])
    return ttt(1), delta, ttt(64)[0]


def test_ttt_linear_chunk_one_is_delta_rule_and_minibatch_reads_start_state():
    a = make_inputs(37)
    ttt1, delta, ttt64 = _ttt_properties(a)
    assert_tree_close(ttt1, delta)
    # Token 1 of the first mini-batch: both gradients are taken at W_0, not at W_1.
    w0, k, v, lr = a["state"], a["k"], a["v"], a["lr"]
    grad = lambda j: (
        (jnp.einsum("bhvk,bhk->bhv", w0, k[:, j]) - v[:, j])[..., None] * k[:, j, :, None]
    )
    w2 = w0 - lr[:, 0, :, None, None] * grad(0) - lr[:, 1, :, None, None] * grad(1)
    expected = jnp.einsum("bhvk,bhk->bhv", w2, a["q"][:, 1])
    np.testing.assert_allclose(ttt64[:, 1], expected, rtol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_chunking_is_invisible(name):
    ref.check_chunking_is_invisible(CASES[name][0])


def test_ttt_linear_split_at_minibatch_boundary_carries_state():
    op = lambda a, c: ops.ttt_linear(
        a["q"], a["k"], a["v"], a["lr"], initial_state=a["state"], chunk_size=c
    )
    inputs = make_inputs(37, seed=4)
    whole, split = jax.jit(lambda a: (op(a, 8), ref.split_in_two(op, a, 16, 8)))(inputs)
    assert_tree_close(split, whole)


def test_gated_delta_rule_log_alpha_equals_alpha():
    a = make_inputs(37, seed=7)
    args = (a["q"], a["k"], a["v"], a["beta"])
    with_alpha = ops.gated_delta_rule(*args, a["alpha"], initial_state=a["state"], chunk_size=16)
    with_log = ops.gated_delta_rule(
        *args, log_alpha=jnp.log(a["alpha"]), initial_state=a["state"], chunk_size=16
    )
    assert_tree_close(with_log, with_alpha)


def test_gated_delta_rule_float32_strong_forgetting_is_finite_and_matches_per_token():
    a = jax.tree.map(lambda x: x.astype(jnp.float32), make_inputs(37, seed=8))
    t = jnp.arange(37)[None, :, None]
    a["alpha"] = jnp.where(t % 5 == 0, -200.0, -30.0) * jnp.ones_like(a["beta"])  # log_alpha

    def op(a, chunk):
        args = (a["q"], a["k"], a["v"], a["beta"])
        return ops.gated_delta_rule(*args, log_alpha=a["alpha"], chunk_size=chunk)

    ref.check_float32_strong_decay(op, a, ("q", "k", "beta", "alpha"))


def test_dtypes_are_kept():
    a = make_inputs(7)
    for dtype in (jnp.float64, jnp.float32):
        a = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), a)
        o, s = jax.eval_shape(lambda a: ops.delta_rule(a["q"], a["k"], a["v"], a["beta"]), a)
        assert o.dtype == dtype and s.dtype == dtype


def _bad_calls():
    """(argument named in the error, call) pairs, each with exactly one bad argument."""
    a = make_inputs(7)
    q, k, v, x, beta = a["q"], a["k"], a["v"], a["x"], a["beta"]
    alpha, lam, erase, write, decay = a["alpha"], a["lam"], a["erase"], a["write"], a["log_decay"]
    return [
        ("beta", lambda: ops.delta_rule(q, k, v, beta[..., 0])),
        ("k", lambda: ops.delta_rule(q, k[..., :3], v, beta)),
        ("k", lambda: ops.delta_rule(q[:, :3], k, v, beta)),
        ("v", lambda: ops.linear_attention(q, k, v[:1])),
        ("q", lambda: ops.linear_attention(q[0], k, v)),
        ("q", lambda: ops.linear_attention(q.astype(jnp.int32), k, v)),
        ("initial_state", lambda: ops.delta_rule(q, k, v, beta, initial_state=q)),
        ("initial_state", lambda: ops.linear_attention(q, k, v, initial_state=a["state"].mT)),
        ("chunk_size", lambda: ops.delta_rule(q, k, v, beta, chunk_size=0)),
        ("chunk_size", lambda: ops.linear_attention(q, k, v, chunk_size=2.0)),
        ("alpha", lambda: ops.gated_delta_rule(q, k, v, beta)),
        ("log_alpha", lambda: ops.gated_delta_rule(q, k, v, beta, alpha, log_alpha=alpha)),
        ("alpha", lambda: ops.gated_delta_rule(q, k, v, beta, alpha[:, 1:])),
        ("log_alpha", lambda: ops.gated_delta_rule(q, k, v, beta, log_alpha=erase)),
        ("beta", lambda: ops.falcon(q, x, v, erase, lam)),
        ("lam", lambda: ops.falcon(q, x, v, beta, lam[..., None])),
        ("window", lambda: ops.falcon(q, x, v, beta, lam, window=0)),
        ("x", lambda: ops.falcon(q, x[..., :2], v, beta, lam)),
        ("erase", lambda: ops.gdn2(q, k, v, beta, write, decay)),
        ("write", lambda: ops.gdn2(q, k, v, erase, erase, decay)),
        ("log_decay", lambda: ops.gdn2(q, k, v, erase, write, lam)),
        ("chunk_size", lambda: ops.ttt_linear(q, k, v, beta, initial_state=None, chunk_size=None)),
        ("lr", lambda: ops.ttt_linear(q, k, v, write, initial_state=None, chunk_size=4)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_raise_naming_the_argument(index):
    argument, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=f"`{argument}`"):
        call()
