"""The coefficients of a chunk of the Type II ops' momentum rule, from its scalar gates.

TTT-MLP, Titans and ATLAS are instances of one momentum rule on an MLP memory
(``nested.ops.mlp_memory``), written per token with data-dependent scalars per (batch, head):

    S_t     = m_t S_{t-1} - u_t grad L_t(theta_s)          (momentum m; step u)
    theta_t = alpha_t theta_{t-1} + w_t S_t                  (keep alpha = 1 - a; step w)
    L_t     = sum_i band_{t,i} l_i,   l_i = 1/2 |f(x_i) - v_i|^2

TTT-MLP: m = 0, alpha = w = 1, u = lr. Titans: u = step h, w = 1. ATLAS: u = 1, w = h, ``band``
the Omega window of sample gates. With every gradient of a chunk taken at its start state
(theta_s, S_s) the recurrences are linear with scalar coefficients, and the state after token t
of the chunk is

    S_t     = P_t S_s - sum_i Lambda_{t,i} grad l_i(theta_s)
    theta_t = A_t theta_s + c_t S_s - sum_i Gamma_{t,i} grad l_i(theta_s)

with P_t = prod_{j<=t} m_j, A_t = prod_{j<=t} alpha_j, D^x_{t,r} = prod_{r<j<=t} x_j (t >= r),
Lambda = D^m diag(u) band, Gamma = D^alpha diag(w) Lambda, c = D^alpha (w P): (C, C) matrices
from cumulative products (exact with zero gates), never a per-token loop. How the chunks are
scanned, and the online rule's gradients at theta_{t-1}, are ``nested.ops.chunk_scan``'s.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops.documents import Segments
from nested.ops.mlp_memory import ThetaCoefficients

Array = jax.Array


class ChunkCoefficients(NamedTuple):
    """The chunk's coefficients of S_t and of theta_t's decay (module docstring), over the
    chunk's C tokens t and its N samples i (N = C without a window band)."""

    lam: Array  # Lambda (B, H, C, N)
    mom_base: Array | None  # P (B, H, C); None without momentum
    keep: Array | None  # D^alpha (B, H, C, C); None without decay
    base: Array  # A (B, H, C)


def decay_matrix(x: Array, segments: Segments | None = None) -> tuple[Array, Array]:
    """D_{t,r} = prod_{r < j <= t} x_j for t >= r, else 0, and P_t = prod_{j <= t} x_j.

    (B, H, C) -> ((B, H, C, C), (B, H, C)). ``products_below`` builds D. With ``segments``
    (``nested.ops.documents``) D is 0 between segments and P runs from t's segment start s_t,
    P_t = D_{t,s_t} x_{s_t}."""
    decay = products_below(x)
    if segments is None:
        return decay, decay[..., 0] * x[..., :1]
    decay = segments.same * decay
    start = segments.start
    below = jnp.take_along_axis(decay, start[..., None], axis=-1)[..., 0]
    return decay, below * jnp.take_along_axis(x, start, axis=-1)


@jax.custom_jvp
def products_below(x: Array) -> Array:
    """D_{t,r} = prod_{r < j <= t} x_j (t >= r), (..., C) -> (..., C, C): a cumulative product
    down each column (an associative scan: division-free, so exact with zero gates).

    Its derivative is written out (``_products_below_jvp``) because autodiff's, through the
    scan's interleaving, costs dozens of small ops where one matmul does."""
    c = x.shape[-1]
    lower = np.arange(c)[:, None] > np.arange(c)[None, :]
    factors = jnp.where(lower, x[..., :, None], jnp.ones((), x.dtype))
    return jnp.tril(jax.lax.associative_scan(jnp.multiply, factors, axis=x.ndim - 1))


@products_below.defjvp
def _products_below_jvp(primals, tangents):
    """dD_{t,r} = sum_{r < j <= t} D_{t,j} dx_j D_{j-1,r}: the product with factor j left out,
    split into its part above j and below it (no division, so exact with zero gates). As
    matrices dD = D diag(dx) E, E_{j,r} = D_{j-1,r} (D shifted down a row, row 0 zero)."""
    (x,), (dx,) = primals, tangents
    decay = products_below(x)
    below = jnp.concatenate([jnp.zeros_like(decay[..., :1, :]), decay[..., :-1, :]], axis=-2)
    return decay, (decay * dx[..., None, :]) @ below


def window_band(gate: Array, rows) -> Array:
    """Omega-rule weights over samples: token t (chunk row) sums the samples of its window.

    ``gate`` (B, H, N) the samples' gates, ``rows`` (C, window) or (B, 1, C, window) the rows
    of each token's samples in them (``chunk_scan.window_samples``); returns (B, H, C, N) with
    entry ``gate_i`` where sample i lies in token t's window, else 0."""
    xp = np if isinstance(rows, np.ndarray) else jnp  # static rows: a constant mask
    samples = xp.arange(gate.shape[-1]).reshape((1,) * rows.ndim + (-1,))
    inside = xp.any(rows[..., None] == samples, axis=-2)  # (.., C, N)
    inside = inside.reshape((1, 1) * (inside.ndim == 2) + inside.shape)
    return jnp.where(inside, gate[..., None, :], jnp.zeros((), gate.dtype))


def accumulate(decay: Array | None, x: Array) -> Array:
    """sum_r D_{t,r} x_r over the chunk axis 2 of (B, H, C, ...): a masked matmul, or a cumsum
    without decay."""
    if decay is None:
        return jnp.cumsum(x, axis=2)
    return jnp.einsum("bhtr,bhr...->bht...", decay, x)


def coefficients(
    step_in: Array,
    mom: Array | None,
    keep: Array | None,
    band: Array | None,
    segments: Segments | None = None,
) -> ChunkCoefficients:
    """The chunk's coefficients from its gates u, m, alpha (B, H, C) (m, alpha None: 0 and 1)
    and its band (B, H, C, N) (None: one sample per token, weight 1). With ``segments``
    (documents; no band) every segment runs from its own base: the coefficients couple no two
    segments and restart at each segment's start."""
    mom_decay = mom_base = decay = None
    if mom is not None:
        mom_decay, mom_base = decay_matrix(mom, segments)
    if band is None:  # Lambda = D^m diag(u): a column scaling, no matmul
        eye = jnp.eye(step_in.shape[-1], dtype=step_in.dtype)[None, None]
        lam = (mom_decay if mom_decay is not None else eye) * step_in[..., None, :]
    else:
        lam = step_in[..., None] * band
        if mom_decay is not None:
            lam = jnp.einsum("bhtr,bhrn->bhtn", mom_decay, lam)
    if keep is not None:
        decay, base = decay_matrix(keep, segments)
    else:
        base = jnp.ones_like(step_in)
        if segments is not None:  # the sums over earlier tokens stay inside segments
            c = step_in.shape[-1]
            inside = segments.same * np.tril(np.ones((1, 1, c, c), step_in.dtype))
            decay = jnp.broadcast_to(inside, (*step_in.shape, c)).astype(step_in.dtype)
    return ChunkCoefficients(lam, mom_base, decay, base)


def theta_coefficients(coef: ChunkCoefficients, step_out: Array | None) -> ThetaCoefficients:
    """(A, c, Gamma) of theta_t = A_t theta_s + c_t S_s - sum_i Gamma_{t,i} grad l_i, for the
    steps w (B, H, C) (None: 1)."""
    lam, mom_base = coef.lam, coef.mom_base
    if step_out is not None:
        lam = step_out[..., None] * lam
        mom_base = None if mom_base is None else step_out * mom_base
    gamma = accumulate(coef.keep, lam)
    carry = None if mom_base is None else accumulate(coef.keep, mom_base[..., None])[..., 0]
    return ThetaCoefficients(coef.base, carry, gamma)


def previous(x: Array, first: float, axis: int) -> Array:
    """Coefficient rows shifted down one token along ``axis``: row t holds row t - 1 of ``x``
    (the state before token t), row 0 the chunk-start value ``first``."""
    x = jnp.moveaxis(x, axis, -1)
    shifted = jnp.concatenate([jnp.full_like(x[..., :1], first), x[..., :-1]], axis=-1)
    return jnp.moveaxis(shifted, -1, axis)


def before_each_token(
    theta: ThetaCoefficients, segments: Segments | None = None
) -> ThetaCoefficients:
    """The coefficients of theta_{t-1}, the state before token t: rows shifted down one token,
    row 0 the chunk-start state theta_s (A = 1, c = 0, Gamma = 0); with ``segments`` so is the
    first row of every segment (its base state)."""
    carry = None if theta.carry is None else previous(theta.carry, 0.0, -1)
    before = ThetaCoefficients(previous(theta.base, 1.0, -1), carry, previous(theta.gamma, 0.0, -2))
    if segments is None:
        return before
    begins = segments.start == np.arange(theta.base.shape[-1])[None, None]  # (B, 1, C)
    restart = lambda x, first: None if x is None else jnp.where(begins, first, x)
    return ThetaCoefficients(
        restart(before.base, 1.0),
        restart(before.carry, 0.0),
        jnp.where(begins[..., None], 0.0, before.gamma),
    )


def scale_rows(a: Array, x: Array) -> Array:
    """``a_t * x_t`` for (B, H, C) coefficients and (B, H, C, ...) rows."""
    return a.reshape(a.shape + (1,) * (x.ndim - 3)) * x
