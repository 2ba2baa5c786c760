"""nested.ops.loops.remat_scan: lax.scan's values and gradients; one iteration has no loop; a
loop inside another's step is not checkpointed again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested.ops import loops


def _step(carry, x):
    h, total = carry
    h = jnp.tanh(h @ x["w"] + x["b"][None])
    return (h, total + jnp.sum(h**2)), {"h": h, "none": None}


def _inputs(n):
    keys = jax.random.split(jax.random.key(0), 3)
    xs = {
        "w": jax.random.normal(keys[0], (n, 4, 4)) / 2,
        "b": jax.random.normal(keys[1], (n, 4)),
    }
    return (jax.random.normal(keys[2], (3, 4)), jnp.zeros(())), xs


@pytest.mark.parametrize("n", [1, 3])
def test_values_and_gradients_are_those_of_lax_scan(n):
    carry, xs = _inputs(n)

    def loss(scan, carry, xs):
        (h, total), ys = scan(carry, xs)
        assert ys["none"] is None and ys["h"].shape == (n, 3, 4)
        return jnp.sum(h) + total + jnp.sum(ys["h"] ** 3)

    ours = lambda c, x: loops.remat_scan(_step, c, x)
    plain = lambda c, x: jax.lax.scan(_step, c, x)
    value, grads = jax.value_and_grad(loss, argnums=(1, 2))(ours, carry, xs)
    want, want_grads = jax.value_and_grad(loss, argnums=(1, 2))(plain, carry, xs)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_one_iteration_has_no_loop_and_every_step_is_rematerialised():
    for n, loop, remat in ((1, False, True), (3, True, True)):
        carry, xs = _inputs(n)
        grad = jax.grad(lambda c: jnp.sum(loops.remat_scan(_step, c, xs)[0][0]))
        text = str(jax.make_jaxpr(grad)(carry))
        assert ("scan[" in text) is loop, text
        assert ("checkpoint[" in text or "remat" in text) is remat, text


def _nested(scan, carry, xs):
    """An outer loop of 2 iterations whose step runs an inner loop over ``xs``."""

    def outer(carry, scale):
        h, total = carry
        (h, inner_total), _ = scan(_step, (h * scale, total), xs)
        return (h, inner_total), jnp.sum(h)

    (h, total), ys = scan(outer, carry, jnp.array([1.0, 0.5]))
    return jnp.sum(h) + total + jnp.sum(ys**2)


@pytest.mark.parametrize("n", [1, 3])
def test_an_enclosed_loop_is_not_checkpointed_again(n):
    carry, xs = _inputs(n)
    ours = lambda step, c, x: loops.remat_scan(step, c, x)
    plain = lambda step, c, x: jax.lax.scan(step, c, x)
    value, grads = jax.value_and_grad(_nested, argnums=(1, 2))(ours, carry, xs)
    want, want_grads = jax.value_and_grad(_nested, argnums=(1, 2))(plain, carry, xs)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    text = str(jax.make_jaxpr(lambda c: _nested(ours, c, xs))(carry))
    assert text.count("checkpoint[") + text.count("remat2[") == 1, text
    # The marking ends with the enclosing step: a loop after it is checkpointed again.
    after = lambda c: loops.remat_scan(_step, (c[0] * _nested(ours, c, xs), c[1]), xs)
    text = str(jax.make_jaxpr(after)(carry))
    assert text.count("checkpoint[") + text.count("remat2[") == 2, text


def test_leading_axes_must_agree():
    carry, xs = _inputs(2)
    xs["b"] = xs["b"][:1]
    with pytest.raises(ValueError, match="leading axes"):
        loops.remat_scan(_step, carry, xs)
