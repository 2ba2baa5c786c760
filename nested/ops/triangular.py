"""Inverse of a unit lower-triangular matrix by matmuls, for the WY form of chunked delta rules.

Chunked delta rules need ``(I + A)^{-1}`` for a strictly lower-triangular ``A`` of size ``L``
(``L`` = chunk length). LAPACK's batched triangular solve is two orders of magnitude slower than a
matmul on XLA:CPU for these small batched matrices, and the doubling product
``(I - A)(I + A^2)(I + A^4)...`` costs ``2 log2(L) L^3`` flops. Here the inverse is built by block
doubling instead: the inverses of the ``s x s`` diagonal blocks are merged pairwise into inverses
of ``2s x 2s`` blocks,

    [[L11, 0], [L21, L22]]^{-1} = [[X11, 0], [-X22 L21 X11, X22]],   X11 = L11^{-1}, X22 = L22^{-1},

so every level is two batched matmuls and the total is about ``2 L^3 / 3`` flops, exact in
exact arithmetic (no series truncation).
"""

import jax
import jax.numpy as jnp

_SMALL = 4  # largest block size multiplied elementwise instead of by a dot


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_doubling_inverse(a: jax.Array) -> jax.Array:
    size = a.shape[-1]
    padded = _next_power_of_two(size)
    if padded != size:  # zero rows/columns extend I + A by an identity block: inert
        pad = [(0, 0)] * (a.ndim - 2) + [(0, padded - size)] * 2
        a = jnp.pad(a, pad)
    batch = a.shape[:-2]
    inv = jnp.ones(batch + (padded, 1, 1), a.dtype)  # inverses of the 1 x 1 diagonal blocks
    s = 1
    while s < padded:
        n = padded // (2 * s)
        blocks = a.reshape(batch + (n, 2 * s, n, 2 * s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # (..., n, 2s, 2s)
        x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -_matmul(_matmul(x22, blocks[..., s:, :s]), x11)
        top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
        bottom = jnp.concatenate([lower, x22], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :size, :size]


def _matmul(a, b):
    # XLA:CPU runs a batched dot as one small GEMM per batch element, which costs microseconds
    # each for the many tiny blocks of the first levels; a fused multiply-sum does not.
    if a.shape[-1] <= _SMALL:
        return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return a @ b


@jax.custom_jvp
def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + A)^{-1}`` for ``A`` (..., L, L) strictly lower triangular (upper part ignored).

    Differentiable in forward and reverse mode through ``d(I + A)^{-1} = -X dA X``, which is
    cheaper than differentiating the block recursion.
    """
    return _block_doubling_inverse(jnp.tril(a, -1))


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
    (a,), (da,) = primals, tangents
    inv = unit_lower_inverse(a)
    return inv, -(inv @ jnp.tril(da, -1)) @ inv
