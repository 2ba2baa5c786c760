"""MemT's Stable GDN-2 against its per-token reference (float64), and strong decays in float32."""

import jax
import jax.numpy as jnp
import pytest
from helpers import reference_linear as ref
from helpers.reference_linear import make_inputs

from nested import ops


def op(a, chunk):
    args = (a["q"], a["k"], a["v"], a["erase"], a["write"], a["log_decay"])
    return ops.gdn2(*args, initial_state=a["state"], chunk_size=chunk)


def reference(a):
    args = (a["q"], a["k"], a["v"], a["erase"], a["write"], a["log_decay"], a["state"])
    return ref.gdn2(*args, scale=ref.DK**-0.5)


NAMES = ("q", "k", "v", "erase", "write", "log_decay", "state")


@pytest.mark.slow
def test_values_and_gradients_match_reference():
    ref.check_against_reference(op, reference, NAMES)


def test_chunking_is_invisible():
    ref.check_chunking_is_invisible(op)


def test_default_scale_is_inverse_sqrt_dk():
    a = make_inputs(7)
    args = (a["q"], a["k"], a["v"], a["erase"], a["write"], a["log_decay"])
    default, explicit = jax.jit(
        lambda: (ops.gdn2(*args), ops.gdn2(*args, scale=ref.DK**-0.5, chunk_size=4))
    )()
    ref.assert_tree_close(default, explicit)


def test_float32_strong_decay_is_finite_and_matches_per_token():
    # Cumulative decays of thousands of nats per chunk: exp of them overflows float32 unless
    # every factor is formed from a non-positive log-difference.
    a = jax.tree.map(lambda x: x.astype(jnp.float32), make_inputs(37, seed=8))
    t = jnp.arange(37)[None, :, None, None]
    strong = jnp.where(t % 5 == 0, -200.0, -30.0) * jnp.ones_like(a["log_decay"])
    mixed = jnp.where(jnp.arange(ref.DK) % 2 == 0, strong, a["log_decay"])  # per key dim
    ref.check_float32_strong_decay(op, {**a, "log_decay": mixed}, NAMES)
