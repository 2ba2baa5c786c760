"""Falcon fast-weight memories: normalised online ridge regression (Falcon-1, -2 and -3).

Falcon-1 (one gain per head, ``beta (B, T, H)``):

    W_t = (1 - e_t l_t) W_{t-1} + e_t (v_t - W_{t-1} x_t) x_t^T,
    e_t = b_t / (|x_t|^2 + l_t + eps),

an SGD step on ``1/2 |W x_t - v_t|^2 + l_t/2 |W|^2`` with an input-normalised step size.
Falcon-2 (``beta (B, T, H, d_v)``): one gain per value channel, i.e. row ``i`` of ``W`` uses
``e_{t,i} = b_{t,i} / (|x_t|^2 + l_t + eps)`` and retention ``1 - e_{t,i} l_t``.
Falcon-3 (``window = c > 1``): the same regression over the last ``c`` samples,

    W_t = (1 - e_t l_t) W_{t-1} + e_t sum_{i=t-c+1..t} (v_i - W_{t-1} x_i) x_i^T,
    e_t = b_t / (sum_{i=t-c+1..t} |x_i|^2 + l_t + eps),

with the window truncated at the start of the sequence (of each call: a split sequence
restarts its window). ``window=1`` is Falcon-1 exactly (the same computation), and a per-channel
``beta`` combines with a window (gains ``e_{t,i}``).

As an instance of :func:`nested.ops.chunked.delta_family`: retention ``a_t = 1 - e_t l_t``
(a per-head or per-row decay), erase strength and write gain ``e_t``, the erase applied to the
undecayed state, and a window of ``c`` key/value pairs per token. Erasing before the decay
avoids the division in the equivalent gated-delta form (``beta' = e_t / a_t``), which is
ill-conditioned when ``a_t`` is small. ``beta`` in [0, 1] keeps ``a_t > 0`` (needed for the
log-retentions of the chunked form); ``x`` is the temporally aligned input ``x_t = phi(k_{t-1})``
built by the layer.

Reference: "Fast Weight Attention for Continual Learning" (Falcon).
"""

import jax.numpy as jnp

from nested.ops import validation
from nested.ops.chunked import default_chunk_size, delta_family


def falcon(
    q,
    x,
    v,
    beta,
    lam,
    *,
    eps=1e-6,
    window=1,
    initial_state=None,
    chunk_size=None,
    scale=1.0,
    starts=None,
    start_state=None,
):
    """Falcon-1/2/3 memory (see the module docstring for the equations); ``o_t = scale W_t q_t``.

    Args:
      q: ``(B, T, H, d_k)`` queries.
      x: ``(B, T, H, d_k)`` aligned inputs (keys of the regression).
      v: ``(B, T, H, d_v)`` targets.
      beta: ``(B, T, H)`` gains (Falcon-1) or ``(B, T, H, d_v)`` per value channel (Falcon-2),
        in [0, 1].
      lam: ``(B, T, H)`` ridge coefficients ``l_t >= 0``.
      eps: stabiliser of the normalisation, ``> 0``.
      window: number ``c`` of recent samples regressed on at each step (Falcon-3 when > 1).
      initial_state: ``(B, H, d_v, d_k)``; ``None`` means zeros.
      chunk_size: tokens per parallel chunk (compute only); ``None`` = fastest, 1 = per token.
      scale: read scale.
      starts, start_state: packed documents, as in :func:`nested.ops.linear_attention`
        (``window=1`` only).

    Returns:
      ``(o (B, T, H, d_v), final_state (B, H, d_v, d_k))``.
    """
    b, t, h, dk, dv = validation.check_qkv(q, x, v, key_name="x")
    per_channel = beta is not None and beta.ndim == 4
    if per_channel:
        validation.check_shape("beta", beta, (b, t, h, dv), "(B, T, H, d_v)")
    else:
        validation.check_shape("beta", beta, (b, t, h), "(B, T, H) or (B, T, H, d_v)")
    validation.check_shape("lam", lam, (b, t, h), "(B, T, H)")
    validation.check_int("window", window)
    validation.check_state(initial_state, b, h, dv, dk)
    validation.check_int("chunk_size", chunk_size, optional=True)
    validation.check_documents(starts, start_state, b, t, h, dv, dk)

    norm = _window_sum(jnp.sum(jnp.square(x), axis=-1), window) + lam + eps  # (B, T, H)
    if per_channel:
        gain = beta / norm[..., None]  # (B, T, H, d_v): e_{t,i}
        retention = jnp.log1p(-gain * lam[..., None])
    else:
        gain = beta / norm
        retention = jnp.log1p(-gain * lam)
    size = chunk_size or default_chunk_size(row_gates=per_channel, slots=window)
    return delta_family(
        q * scale,
        x,
        v,
        gain,
        retention,
        write=gain,
        window=window,
        erase_after_decay=False,
        initial_state=initial_state,
        chunk_size=size,
        starts=starts,
        initial=start_state,
    )


def _window_sum(x, c):
    """``sum_{m < c} x_{t-m}`` over axis 1 of ``x (B, T, H)``, zeros before the start."""
    padded = jnp.pad(x, ((0, 0), (c - 1, 0), (0, 0)))
    return sum(padded[:, c - 1 - m : c - 1 - m + x.shape[1]] for m in range(c))
