"""Chunk machinery shared by the Type II ops (TTT-MLP, Titans, ATLAS).

All three are instances of one momentum rule on an MLP memory (``nested.ops.mlp_memory``),
written per token with data-dependent scalars per (batch, head):

    S_t     = m_t S_{t-1} - u_t grad L_t(theta_s)          (momentum; "mom", "step_in")
    theta_t = alpha_t theta_{t-1} + w_t S_t                  (decay keep alpha = 1 - a; "step_out")
    L_t     = sum_i band_{t,i} l_i,   l_i = 1/2 |f(x_i) - v_i|^2

TTT-MLP: m = 0, alpha = w = 1, u = lr. Titans: u = step h, w = 1. ATLAS: u = 1, w = h, ``band``
the Omega window of sample gates. Mini-batch semantics (``every = C``): within a chunk starting
at (theta_s, S_s) every gradient is taken at theta_s; with chunk size 1 this is the online rule.

Because the recurrences are linear with scalar coefficients, the state after token t is

    S_t     = P_t S_s - sum_i Lambda_{t,i} grad l_i(theta_s)
    theta_t = A_t theta_s + c_t S_s - sum_i Gamma_{t,i} grad l_i(theta_s)

with P_t = prod_{j<=t} m_j, A_t = prod_{j<=t} alpha_j, D^x_{t,r} = prod_{r<j<=t} x_j (t >= r),
Lambda = D^m diag(u) band, Gamma = D^alpha diag(w) Lambda, c = D^alpha (w P): (C, C) matrices
from cumulative products (exact with zero gates), never a per-token loop. The output reads
theta_t through the dual form (``mlp_memory.dual_read``) or reads theta_s (chunk-start reads).

The online rule (chunk size 1: token t's gradient at theta_{t-1}) keeps these coefficients: the
gradients are still rank-one per sample, only taken at different states. It runs in blocks of
ONLINE_BLOCK tokens: inside a block a scan over tokens computes each token's gradient factors
at theta_{t-1} = A_{t-1} theta_s + c_{t-1} S_s - sum_{i<t} Gamma_{t-1,i} grad l_i in dual form
(``online_factors``, ``nested.ops.online``: matrix-vector products with the block-start state,
never a per-token state; its backward is written out), then the block's reads and its end
state are formed as for a chunk.

Sequences of any length are padded with inert tokens (m = alpha = 1, u = w = 0, gate 0, zero
inputs) that leave (theta, S) unchanged, then sliced; the chunk loop is a ``lax.scan`` whose body
is rematerialised (``jax.checkpoint``) so the backward stores only chunk-boundary states.
"""

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops import mlp_memory as mm
from nested.ops import online

Array = jax.Array

# Up to this many chunks the backward stores every chunk's state; beyond, segments of chunks.
FLAT_CHUNKS = 64
# Tokens per scan step of the online rule (chunk size 1): the state is formed once a block.
ONLINE_BLOCK = 16
# Padding values that make a token a no-op of the rule above; absent names pad with 0.
INERT = {"keep": 1.0, "mom": 1.0}
READS = ("after_write", "chunk_start")


def check_sequence(q, k, v, gates: dict[str, Array], chunk_size) -> tuple[int, int, int]:
    """Validate (B, T, H, D) inputs and (B, T, H) gates; returns (B, T, H)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be (B, T, H, D); got shapes {q.shape}, {k.shape}, {v.shape}."
        )
    if q.shape != k.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must have the same shape.")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v {v.shape} must share (B, T, H) with q {q.shape}.")
    for name, g in gates.items():
        if g.shape != q.shape[:3]:
            raise ValueError(f"{name} has shape {g.shape}, expected (B, T, H) = {q.shape[:3]}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    return q.shape[:3]


def check_read(read: str) -> None:
    if read not in READS:
        raise ValueError(f"read={read!r} is unknown; use one of {READS}.")


def cast(tree, dtype):
    """Cast every array leaf to the compute dtype (the scan carry must keep one dtype)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def decay_matrix(x: Array) -> tuple[Array, Array]:
    """D_{t,r} = prod_{r < j <= t} x_j for t >= r, else 0, and P_t = prod_{j <= t} x_j.

    (..., C) -> ((..., C, C), (..., C)). ``products_below`` builds D."""
    decay = products_below(x)
    return decay, decay[..., 0] * x[..., :1]


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


def window_band(gate: Array, window: int) -> Array:
    """Omega-rule weights over samples: token t (chunk row) sums samples t .. t + window - 1.

    ``gate`` (B, H, N) covers the window - 1 samples before the chunk then the chunk's C tokens;
    returns (B, H, C, N) with entry ``gate_i`` where sample i lies in token t's window."""
    n = gate.shape[-1]
    c = n - window + 1
    t, i = np.arange(c)[:, None], np.arange(n)[None, :]
    inside = (i >= t) & (i < t + window)
    return jnp.where(inside[None, None], gate[..., None, :], jnp.zeros((), gate.dtype))


def accumulate(decay: Array | None, x: Array) -> Array:
    """sum_r D_{t,r} x_r over the chunk axis 2 of (B, H, C, ...): a masked matmul, or a cumsum
    without decay."""
    if decay is None:
        return jnp.cumsum(x, axis=2)
    return jnp.einsum("bhtr,bhr...->bht...", decay, x)


def coefficients(xs: dict[str, Array], band: Array | None):
    """Per-chunk coefficients of the rule (module docstring).

    Returns dict with ``lam`` (B, H, C, N), ``mom_base`` P (B, H, C) or None, ``keep`` D^alpha
    (B, H, C, C) or None (no decay), ``base`` A (B, H, C)."""
    u = xs["step_in"]
    mom_decay = mom_base = keep = None
    if "mom" in xs:
        mom_decay, mom_base = decay_matrix(xs["mom"])
    if band is None:  # Lambda = D^m diag(u): a column scaling, no matmul
        eye = jnp.eye(u.shape[-1], dtype=u.dtype)[None, None]
        lam = (mom_decay if mom_decay is not None else eye) * u[..., None, :]
    else:
        lam = u[..., None] * band
        if mom_decay is not None:
            lam = jnp.einsum("bhtr,bhrn->bhtn", mom_decay, lam)
    if "keep" in xs:
        keep, base = decay_matrix(xs["keep"])
    else:
        base = jnp.ones_like(u)
    return {"lam": lam, "mom_base": mom_base, "keep": keep, "base": base}


def theta_coefficients(coef, step_out: Array | None):
    """(c, Gamma) of theta_t = A_t theta_s + c_t S_s - sum_i Gamma_{t,i} grad l_i."""
    lam, mom_base = coef["lam"], coef["mom_base"]
    if step_out is not None:
        lam = step_out[..., None] * lam
        mom_base = None if mom_base is None else step_out * mom_base
    gamma = accumulate(coef["keep"], lam)
    carry = None if mom_base is None else accumulate(coef["keep"], mom_base[..., None])[..., 0]
    return carry, gamma


def window_samples(prefix, xs, window: int):
    """Samples (k, v) the chunk's losses use, their Omega band (None: one sample per token), and
    the prefix (last window - 1 samples) carried to the next chunk."""
    if "gate" not in xs:
        return xs["k"], xs["v"], None, prefix
    if window == 1:
        return xs["k"], xs["v"], window_band(xs["gate"], 1), prefix
    k, v, g = (jnp.concatenate([prefix[n], xs[n]], axis=2) for n in ("k", "v", "gate"))
    tail = {"k": k[:, :, 1 - window :], "v": v[:, :, 1 - window :], "gate": g[:, :, 1 - window :]}
    return k, v, window_band(g, window), tail


def scale_rows(a: Array, x: Array) -> Array:
    """``a_t * x_t`` for (B, H, C) coefficients and (B, H, C, ...) rows."""
    return a.reshape(a.shape + (1,) * (x.ndim - 3)) * x


def next_state(params, momentum, base, carry, mom_base, gamma, lam, inputs, deltas):
    """(theta, S) after the chunk's last row of coefficients (inert padding rows change nothing).

    The minus sign goes into the (N,) weights, not onto parameter-sized arrays."""
    steps = mm.weighted_grads(-gamma, inputs, deltas, params)
    if momentum is None:
        return jax.tree.map(lambda p, g: mm.scale(base, p) + g, params, steps), None
    new_params = jax.tree.map(
        lambda p, s, g: mm.scale(base, p) + mm.scale(carry, s) + g, params, momentum, steps
    )
    steps = mm.weighted_grads(-lam, inputs, deltas, params)
    return new_params, jax.tree.map(lambda s, g: mm.scale(mom_base, s) + g, momentum, steps)


def sample_rows(c: int, window: int) -> np.ndarray:
    """(C, window): the rows of token t's samples in [prefix; chunk] arrays, t .. t + window - 1."""
    return np.arange(c)[:, None] + np.arange(window)


def previous(x: Array, first: float, axis: int) -> Array:
    """Coefficient rows shifted down one token along ``axis``: row t holds row t - 1 of ``x``
    (the state before token t), row 0 the chunk-start value ``first``."""
    x = jnp.moveaxis(x, axis, -1)
    shifted = jnp.concatenate([jnp.full_like(x[..., :1], first), x[..., :-1]], axis=-1)
    return jnp.moveaxis(shifted, -1, axis)


def online_factors(params, momentum, prev, k: Array, v: Array, form: mm.MemoryForm, window: int):
    """Gradient factors of the online rule over one block (``online.block_factors``): token t's
    gradient is taken at theta_{t-1}, which is in dual form over the block's earlier tokens.

    Args:
      prev: (A, c, Gamma) of theta_{t-1} (A (B, H, C), c (B, H, C) or None, Gamma
        (B, H, C, C * window), column j * window + s the s-th sample of token j).
      k, v: (B, H, window - 1 + C, d) samples: token t's window is rows t .. t + window - 1.
    Returns:
      ``(inputs, deltas)`` as from ``sample_grads``, C * window rows, token by token.
    """
    c = prev[0].shape[-1]
    rows = sample_rows(c, window)
    keys = k[:, :, rows.reshape(-1)]  # (B, H, C * window, d)
    per_token = lambda x: x.reshape(*x.shape[:2], c, window, x.shape[-1])
    # The first layer's inputs are the samples, known for the whole block: its products with
    # the block-start state and its dual-form scores are one matmul each, not one a token.
    scores = mm.dual_scores(params[0], keys, keys)
    first = (
        per_token(mm.affine(params[0], keys)),
        None if momentum is None else per_token(mm.affine(momentum[0], keys)),
        per_token(scores),
    )
    rest = lambda p: None if p is None else (None, *p[1:])
    hidden, deltas = online.block_factors(
        form,
        rest(params),
        rest(momentum),
        prev,
        first,
        v[:, :, rows],
        per_token(keys) if form.residual_norm else None,
    )
    return (keys, *hidden), deltas


def linear_rule_step(carry, xs, *, form: mm.MemoryForm, read: str, window: int, online: bool):
    """One chunk of the rule for linear-in-gradient updates (TTT-MLP, Titans, ATLAS w/o Muon).

    Mini-batch (``online=False``): every gradient at the chunk-start state. Online: token t's
    gradient at theta_{t-1} (``online_factors``), so the chunk is only a block of the scan.
    carry: (params, momentum or None, prefix or None); xs: per-chunk (B, H, C, ...) arrays.
    Returns (carry, o (B, H, C, d_out))."""
    params, momentum, prefix = carry
    k, v, band, prefix = window_samples(prefix, xs, window)
    coef = coefficients(xs, None if online else band)
    carry_c, gamma = theta_coefficients(coef, xs.get("step_out"))
    base, lam = coef["base"], coef["lam"]
    if online:
        # Per-token coefficients spread over each token's samples (columns (token, sample)),
        # times the samples' gates.
        c = base.shape[-1]
        if band is None:
            gates = jnp.ones((*base.shape, 1), base.dtype)
        else:
            gates = band[:, :, np.arange(c)[:, None], sample_rows(c, window)]
        per_sample = lambda m: (m[..., None] * gates[:, :, None]).reshape(*m.shape[:-1], -1)
        before = (
            previous(base, 1.0, -1),
            None if carry_c is None else previous(carry_c, 0.0, -1),
            per_sample(previous(gamma, 0.0, -2)),
        )
        gamma, lam = per_sample(gamma), per_sample(lam)
        inputs, deltas = online_factors(params, momentum, before, k, v, form, window)
    else:
        inputs, deltas = mm.sample_grads(params, k, v, form)
    if read == "after_write":
        o = mm.dual_read(params, momentum, base, carry_c, gamma, xs["q"], inputs, deltas, form)
    elif online:  # theta_{t-1}
        o = mm.dual_read(params, momentum, *before, xs["q"], inputs, deltas, form)
    else:
        o = mm.mlp_apply(params, xs["q"], form)
    last = lambda x: None if x is None else x[..., -1]
    new_params, momentum = next_state(
        params,
        momentum,
        base[..., -1],
        last(carry_c),
        last(coef["mom_base"]),
        gamma[..., -1, :],
        lam[..., -1, :],
        inputs,
        deltas,
    )
    return (new_params, momentum, prefix), o


def scan_rule(carry, seq: dict[str, Array], *, chunk_size: int, form, read: str, window: int):
    """``linear_rule_step`` over a sequence (``scan_chunks``): mini-batches of ``chunk_size``, or
    for ``chunk_size=1`` the online rule, ONLINE_BLOCK tokens a scan step."""
    online = chunk_size == 1
    step = partial(linear_rule_step, form=form, read=read, window=window, online=online)
    return scan_chunks(step, carry, seq, chunk_size=ONLINE_BLOCK if online else chunk_size)


def segment_size(n_chunks: int) -> int:
    """Chunks per rematerialised segment: 1 (flat) up to FLAT_CHUNKS chunks, else the size in
    [sqrt(n) / 2, sqrt(n)] that pads the fewest chunks (the largest among equals): 8 for 128."""
    if n_chunks <= FLAT_CHUNKS:
        return 1
    root = math.isqrt(n_chunks - 1) + 1
    return min(range(root, max(2, root // 2) - 1, -1), key=lambda g: -n_chunks % g)


def scan_chunks(step: Callable, carry, seq: dict[str, Array], *, chunk_size: int):
    """Run ``step(carry, chunk) -> (carry, o)`` over chunks of a sequence.

    seq: name -> (B, T, H, ...) arrays, padded at the end with ``INERT`` tokens to whole chunks
    and handed to ``step`` as (B, H, C, ...) chunks. Returns (o (B, T, H, d), carry).

    Each chunk is rematerialised, so the backward keeps one (theta, S) per chunk, plus for the
    online form the per-token vectors its scan saves (``online.SAVED``: linear in T). Beyond
    FLAT_CHUNKS chunks (e.g. online sequences beyond 1024 tokens) that state count is cut to
    about 2 sqrt(n) by rematerialising segments of sqrt(n) chunks too, for one more forward of
    everything but the online scans (their saved vectors are kept across segments too).
    """
    batch, length = next(iter(seq.values())).shape[:2]
    n_chunks = -(-length // chunk_size)
    group = segment_size(n_chunks)
    n_chunks = -(-n_chunks // group) * group
    pad = n_chunks * chunk_size - length

    def to_chunks(name, x):
        if pad:
            widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, widths, constant_values=INERT.get(name, 0.0))
        x = x.reshape(batch, n_chunks, chunk_size, *x.shape[2:])
        x = jnp.moveaxis(x, (1, 3), (0, 2))  # (n, B, H, C, ...)
        return x if group == 1 else x.reshape(n_chunks // group, group, *x.shape[1:])

    xs = {name: to_chunks(name, x) for name, x in seq.items()}
    keep = jax.checkpoint_policies.save_only_these_names(online.SAVED)
    body = jax.checkpoint(step, prevent_cse=False, policy=keep)
    if group > 1:
        inner = body
        body = jax.checkpoint(
            lambda c, x: jax.lax.scan(inner, c, x), prevent_cse=False, policy=keep
        )
    carry, o = jax.lax.scan(body, carry, xs)
    o = o.reshape(n_chunks, *o.shape[-4:])
    o = jnp.moveaxis(o, (0, 2), (1, 3))  # (B, n, C, H, d)
    o = o.reshape(batch, n_chunks * chunk_size, *o.shape[3:])
    return o[:, :length], carry
