"""The pure functions memories and rules are made of, beneath every layer of nested.

Products of rows with a weight matrix (:func:`rows_times`), activations, the MLP memory network
``f(x) = L_depth(act(... act(L_1 x)))`` (or ``x + LN(f(x))``), ATLAS's polynomial feature map,
Muon's Newton-Schulz orthogonalisation, and the broadcast of a state to every sequence of a
batch. The declarations (:mod:`nested.learn.memories`, :mod:`nested.learn.rules`) and the
kernels (:mod:`nested.ops`) both compute with these, so a kernel and the definition it is
proven against share one copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def broadcast_rows(x: jax.Array, n: int) -> jax.Array:
    """``x (...) -> (n, ...)``, every row ``x``; its transpose sums the cotangent's rows. On a
    CPU the sum is a product with a vector of ones: XLA's CPU reduction over a leading axis
    of more than about 32K kept elements reads with the row stride and runs 20-80x slower
    (``(16, 65536)``: 9.6 ms against 0.11 ms, float32, jax 0.10). Integer arrays (no
    cotangent) are broadcast as they are."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.broadcast_to(x, (n, *x.shape))
    return _broadcast_rows(x, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _broadcast_rows(x, n):
    return jnp.broadcast_to(x, (n, *x.shape))


def _broadcast_rows_fwd(x, n):
    return _broadcast_rows(x, n), None


def _broadcast_rows_bwd(n, _, cotangent):
    rows = cotangent.reshape(n, -1)
    as_product = lambda: jnp.einsum(
        "n,nk->k", jnp.ones((n,), rows.dtype), rows, precision=jax.lax.Precision.HIGHEST
    )
    total = jax.lax.platform_dependent(cpu=as_product, default=lambda: jnp.sum(rows, axis=0))
    return (total.reshape(cotangent.shape[1:]),)


_broadcast_rows.defvjp(_broadcast_rows_fwd, _broadcast_rows_bwd)


def rows_times(x, kernel, *, precision=None, preferred_element_type=None):
    """``x (..., n_in) @ kernel (n_in, n_out)`` with the gradients written out in the operands'
    own layouts, ``dx = g W^T`` and ``dW = x^T g`` (``g`` the cotangent of the output,
    contracted over every leading dim): the product's values and gradients. Why: JAX's
    transpose of the product forms ``dW^T = g^T x`` and transposes it; XLA:CPU folds that
    transpose into the fusion producing ``g`` (an activation's derivative, a convolution's
    taps, the softmax), a strided loop several times slower than the products themselves
    (benchmarks/README.md, ``lm_profile``: a step's time by part)."""
    return _rows_times(x, kernel, precision, preferred_element_type)


def _product(x, kernel, precision, preferred_element_type):
    return jax.lax.dot_general(
        x,
        kernel,
        (((x.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rows_times(x, kernel, precision, preferred_element_type):
    return _product(x, kernel, precision, preferred_element_type)


def _rows_times_fwd(x, kernel, precision, preferred_element_type):
    return _product(x, kernel, precision, preferred_element_type), (x, kernel)


def _rows_times_bwd(precision, preferred_element_type, residuals, g):
    x, kernel = residuals
    lead = tuple(range(x.ndim - 1))
    dx = jax.lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())), precision=precision)
    dkernel = jax.lax.dot_general(x, g, ((lead, lead), ((), ())), precision=precision)
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


_rows_times.defvjp(_rows_times_fwd, _rows_times_bwd)


def dense_dot_general(
    x, kernel, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
):
    """``lax.dot_general`` for ``nnx.Linear(dot_general=...)``: its product ``x @ W`` is
    :func:`rows_times`'s (the same values and gradients, faster on XLA:CPU); other contractions,
    and products with an output sharding, are ``lax.dot_general``'s."""
    contract, batch = dimension_numbers
    if (
        batch == ((), ())
        and tuple(map(tuple, contract)) == ((x.ndim - 1,), (0,))
        and kernel.ndim == 2
        and out_sharding is None
    ):
        return rows_times(
            x, kernel, precision=precision, preferred_element_type=preferred_element_type
        )
    return jax.lax.dot_general(
        x,
        kernel,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
}


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis without gain or bias."""
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)


def mlp_forward(
    linear: Callable[[int, jax.Array], jax.Array],
    x: jax.Array,
    depth: int,
    act: Callable[[jax.Array], jax.Array],
    residual_norm: bool = False,
    norm_eps: float = 1e-6,
) -> jax.Array:
    """The MLP memory network with each layer's affine map given by ``linear(layer, input)``:
    ``f(x) = L_depth(act(... act(L_1 x)))``, or ``x + LN(f(x))`` with ``residual_norm``.
    Shared by :class:`nested.learn.memories.MLP` and the chunked ops
    (:mod:`nested.ops.mlp_memory`)."""
    u = x
    for layer in range(depth):
        z = linear(layer, u)
        u = act(z) if layer < depth - 1 else z
    return mlp_output(x, u, residual_norm, norm_eps)


def mlp_output(x: jax.Array, u: jax.Array, residual_norm: bool, norm_eps: float) -> jax.Array:
    """The network's output from its last layer's ``u``: ``u``, or ``x + LN(u)`` (TTT form)."""
    return x + layer_norm(u, norm_eps) if residual_norm else u


def polynomial_features(x: jax.Array, degree: int = 2) -> jax.Array:
    """``phi(x) = [x, x^2/2!, ..., x^p/p!]`` elementwise, concatenated: ``d -> p d``."""
    powers, term = [], jnp.ones_like(x)
    for p in range(1, degree + 1):
        term = term * x / p
        powers.append(term)
    return jnp.concatenate(powers, axis=-1)


MUON_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    x: jax.Array, steps: int = 5, coeffs: tuple[float, float, float] = MUON_COEFFS, eps=1e-7
) -> jax.Array:
    """Approximate orthogonalisation ``U V^T`` of ``x = U S V^T`` (Muon, Jordan et al. 2024).

    ``x (..., m, n)`` is scaled to unit Frobenius norm, smoothly (``x / sqrt(|x|^2 + eps^2)``,
    differentiable at 0), then ``steps`` quintic iterations ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T`` on the short side push its singular values towards 1 (Muon's coefficients
    leave them in about [0.7, 1.2]).
    """
    a, b, c = coeffs
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else jnp.swapaxes(x, -1, -2)
    x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True) + eps**2)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else jnp.swapaxes(x, -1, -2)
