"""The pure functions memories and rules are made of, beneath every layer of nested.

Activations, the MLP memory network ``f(x) = L_depth(act(... act(L_1 x)))`` (or ``x + LN(f(x))``),
ATLAS's polynomial feature map, Muon's Newton-Schulz orthogonalisation, and the broadcast of a
state to every sequence of a batch. The declarations
(:mod:`nested.learn.memories`, :mod:`nested.learn.rules`) and the kernels (:mod:`nested.ops`)
both compute with these, so a kernel and the definition it is proven against share one copy.
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
