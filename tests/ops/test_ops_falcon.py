"""Falcon-1/2/3 against per-token references (float64), and their equivalences."""

import jax
import jax.numpy as jnp
import pytest
from helpers import reference_linear as ref
from helpers.reference_linear import EPS_FALCON as EPS
from helpers.reference_linear import assert_tree_close, make_inputs

from nested import ops


def falcon_case(beta_name, window):
    def op(a, chunk):
        args = (a["q"], a["x"], a["v"], a[beta_name], a["lam"])
        return ops.falcon(
            *args, eps=EPS, window=window, initial_state=a["state"], chunk_size=chunk, scale=0.7
        )

    def reference(a):
        args = (a["q"], a["x"], a["v"], a[beta_name], a["lam"], a["state"], EPS)
        if window == 1 and beta_name == "beta":
            return ref.falcon1(*args, scale=0.7)
        return ref.falcon_window(*args, window, scale=0.7)

    return op, reference, ("q", "x", "v", beta_name, "lam", "state"), ref.LENGTHS_AND_CHUNKS


CASES = {
    "falcon1": falcon_case("beta", 1),
    "falcon2": falcon_case("beta_rows", 1),
    "falcon3": falcon_case("beta", 3),
    # Per-channel gains with a window: the composition of the two cases above, one length.
    "falcon2_window2": falcon_case("beta_rows", 2)[:3] + (((37, (4, None)),),),
}


@pytest.mark.parametrize(  # with -m slow but falcon2_window2 (per-channel gains and a window)
    "name",
    [n if n == "falcon2_window2" else pytest.param(n, marks=pytest.mark.slow) for n in CASES],
)
def test_values_and_gradients_match_reference(name):
    ref.check_against_reference(*CASES[name])


@pytest.mark.parametrize("name", ["falcon1", "falcon2"])
def test_chunking_is_invisible(name):
    # A window restarts at every call, so split calls equal one call only for window=1.
    ref.check_chunking_is_invisible(CASES[name][0])


def test_window_one_is_falcon1_and_equal_channel_gains_are_falcon1():
    a = make_inputs(37, seed=6)
    rows = jnp.broadcast_to(a["beta"][..., None], a["beta"].shape + (ref.DV,))

    def run(a):
        args = (a["q"], a["x"], a["v"])
        call = lambda beta, window: ops.falcon(
            *args, beta, a["lam"], eps=EPS, window=window, initial_state=a["state"]
        )
        return call(a["beta"], 1), call(rows, 1), call(a["beta"], 3)

    window1, channels, window3 = jax.jit(run)(a)
    args = (a["q"], a["x"], a["v"], a["beta"], a["lam"], a["state"], EPS)
    assert_tree_close(window1, ref.falcon1(*args))
    assert_tree_close(channels, window1)
    assert float(jnp.max(jnp.abs(window3[0] - window1[0]))) > 1e-3  # the window matters
