"""Hebbian (linear attention), DeltaNet and Gated DeltaNet memories, chunkwise exact.

All three are instances of :func:`nested.ops.chunked.delta_family` (see that module for the
chunked WY form). ``chunk_size`` is a compute choice only: every value gives the per-token
recurrence's outputs and gradients; ``None`` picks the fastest measured size and ``1`` runs the
plain per-token ``lax.scan``. Keys are used as given (layers L2-normalise them).

References: Katharopoulos et al. 2020 (linear attention); Schlag et al. 2021 and Yang et al. 2024
(DeltaNet, parallel chunkwise form); Yang, Kautz & Hatamizadeh 2025 (Gated DeltaNet).
"""

import jax.numpy as jnp

from nested.ops import validation
from nested.ops.chunked import default_chunk_size, delta_family


def linear_attention(
    q, k, v, *, initial_state=None, chunk_size=None, scale=1.0, starts=None, start_state=None
):
    """Hebbian memory: ``W_t = W_{t-1} + v_t k_t^T``, ``o_t = scale * W_t q_t``.

    Args:
      q, k: ``(B, T, H, d_k)`` queries and keys.
      v: ``(B, T, H, d_v)`` values.
      initial_state: ``(B, H, d_v, d_k)``; ``None`` means zeros.
      chunk_size: tokens per parallel chunk (compute only); ``None`` = fastest, 1 = per token.
      scale: read scale.
      starts: ``(B, T)`` bool, True where a new document starts inside the sequence (packed
        documents, flash-linear-attention's ``cu_seqlens``): each document runs as if alone,
        the first from ``initial_state``, every later one from ``start_state``
        ``(B, H, d_v, d_k)``; the final state is the last document's. None: one document.

    Returns:
      ``(o, final_state)``: ``o (B, T, H, d_v)``, ``final_state (B, H, d_v, d_k)``.
    """
    b, t, h, dk, dv = validation.check_qkv(q, k, v)
    validation.check_state(initial_state, b, h, dv, dk)
    validation.check_int("chunk_size", chunk_size, optional=True)
    validation.check_documents(starts, start_state, b, t, h, dv, dk)
    size = chunk_size or default_chunk_size(erase=False)
    return delta_family(
        q * scale,
        k,
        v,
        None,
        None,
        initial_state=initial_state,
        chunk_size=size,
        starts=starts,
        initial=start_state,
    )


def delta_rule(
    q, k, v, beta, *, initial_state=None, chunk_size=None, scale=1.0, starts=None, start_state=None
):
    """DeltaNet: ``W_t = W_{t-1} + b_t (v_t - W_{t-1} k_t) k_t^T``, ``o_t = scale * W_t q_t``.

    One SGD step of size ``b_t`` on ``1/2 |W k_t - v_t|^2`` per token.

    Args:
      q, k: ``(B, T, H, d_k)``; keys are not normalised here.
      v: ``(B, T, H, d_v)``.
      beta: ``(B, T, H)`` write strengths, usually in (0, 1).
      initial_state, chunk_size, scale, starts, start_state: as in :func:`linear_attention`.

    Returns:
      ``(o (B, T, H, d_v), final_state (B, H, d_v, d_k))``.
    """
    documents = starts, start_state
    return _delta(q, k, v, beta, None, None, initial_state, chunk_size, scale, documents)


def gated_delta_rule(
    q,
    k,
    v,
    beta,
    alpha=None,
    *,
    log_alpha=None,
    initial_state=None,
    chunk_size=None,
    scale=1.0,
    starts=None,
    start_state=None,
):
    """Gated DeltaNet: ``W_t = a_t W_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``.

    ``o_t = scale * W_t q_t``. Give the retention either as ``alpha`` in (0, 1] or, better, as
    ``log_alpha = log(alpha) <= 0`` (e.g. ``-softplus(x)``): the chunked form works with
    cumulative log-retentions, so ``log_alpha`` keeps strong forgetting exact in float32
    where ``alpha`` would round to 0.

    Args:
      q, k: ``(B, T, H, d_k)``; v: ``(B, T, H, d_v)``.
      beta: ``(B, T, H)`` write strengths.
      alpha: ``(B, T, H)`` retention factors; exactly one of ``alpha`` and ``log_alpha``.
      log_alpha: ``(B, T, H)`` log retention factors.
      initial_state, chunk_size, scale, starts, start_state: as in :func:`linear_attention`.

    Returns:
      ``(o (B, T, H, d_v), final_state (B, H, d_v, d_k))``.
    """
    name = validation.check_one_of({"alpha": alpha is not None, "log_alpha": log_alpha is not None})
    gate = alpha if name == "alpha" else log_alpha
    documents = starts, start_state
    return _delta(q, k, v, beta, name, gate, initial_state, chunk_size, scale, documents)


def _delta(q, k, v, beta, gate_name, gate, initial_state, chunk_size, scale, documents):
    """Validate, then run the (gated) delta rule through :func:`delta_family`; ``gate``
    (B, T, H) is the retention ``alpha`` or its log (named by ``gate_name``), or None;
    ``documents`` = (starts, start_state)."""
    b, t, h, dk, dv = validation.check_qkv(q, k, v)
    validation.check_shape("beta", beta, (b, t, h), "(B, T, H)")
    if gate is not None:
        validation.check_shape(gate_name, gate, (b, t, h), "(B, T, H)")
    validation.check_state(initial_state, b, h, dv, dk)
    validation.check_int("chunk_size", chunk_size, optional=True)
    validation.check_documents(*documents, b, t, h, dv, dk)
    return delta_family(
        q * scale,
        k,
        beta[..., None] * v,
        beta,
        jnp.log(gate) if gate_name == "alpha" else gate,
        initial_state=initial_state,
        chunk_size=chunk_size or default_chunk_size(),
        starts=documents[0],
        initial=documents[1],
    )
