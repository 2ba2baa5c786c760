"""The matmul-only inverse of unit lower-triangular matrices used by the chunked delta rules."""

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops.triangular import unit_lower_inverse

SIZES = (1, 2, 5, 16, 37)  # powers of two and sizes that need padding


def _dense_inverse(a):
    return jnp.linalg.inv(jnp.eye(a.shape[-1])[None] + jnp.tril(a, -1))


def _value_jvp_and_grad(inverse, a, tangent, cotangent):
    value, jvp = jax.jvp(inverse, (a,), (tangent,))
    grad = jax.grad(lambda a: jnp.sum(inverse(a) * cotangent))(a)
    return value, jvp, grad


def test_inverse_and_its_derivatives_match_dense_inverse():
    problems = []
    for size in SIZES:
        keys = jax.random.split(jax.random.key(size), 3)
        a = 0.3 * jnp.tril(jax.random.normal(keys[0], (3, size, size)), -1)
        tangent = jnp.tril(jax.random.normal(keys[1], a.shape), -1)
        problems.append((a, tangent, jax.random.normal(keys[2], a.shape)))

    def run(problems):
        return [
            (_value_jvp_and_grad(unit_lower_inverse, *p), _value_jvp_and_grad(_dense_inverse, *p))
            for p in problems
        ]

    for size, (got, expected) in zip(
        SIZES,
        jax.jit(run)(problems),
        strict=True,
    ):
        for name, g, e in zip(("value", "jvp", "grad"), got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10, err_msg=f"{name} L={size}")


def test_upper_part_is_ignored():
    a = jax.random.normal(jax.random.key(0), (8, 8))
    np.testing.assert_array_equal(unit_lower_inverse(a), unit_lower_inverse(jnp.tril(a, -1)))
