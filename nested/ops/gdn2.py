"""MemT's Stable Gated DeltaNet-2: gated erase and write with per-key-dimension forgetting.

    u_i = sqrt(erase_i) * k_i,
    W_i = W_{i-1} D_i (I - u_i u_i^T) + (write_i * v_i) u_i^T,   D_i = diag(exp(log_decay_i)),
    o_i = scale * W_i q_i   (scale defaults to 1 / sqrt(d_k), MemT's read ``W q / sqrt(d_k)``).

The decay runs over key dimensions, so the chunked form (:func:`nested.ops.chunked.delta_family`
with ``key_decay=True``) weights each key dimension of every in-chunk inner product by
``exp(g_{t,d} - g_{j,d})``, ``g`` the cumulative log-decay inside the chunk. These factors are
formed pairwise from non-positive log-differences, so arbitrarily strong decays stay finite and
exact in float32 (they underflow to 0 where the true factor does).

Turn semantics (generation reads the snapshot of the memory taken at the start of the turn, the
turn is written afterwards) belong to the layer: read with the incoming state, then call this op
on the turn to get the next state. Reference: MemT-1.0 (Stable GDN-2).
"""

import jax.numpy as jnp

from nested.ops import validation
from nested.ops.chunked import default_chunk_size, delta_family


def gdn2(
    q,
    k,
    v,
    erase,
    write,
    log_decay,
    *,
    initial_state=None,
    chunk_size=None,
    scale=None,
    starts=None,
    start_state=None,
):
    """Stable GDN-2 memory (see the module docstring for the equation).

    Args:
      q, k: ``(B, T, H, d_k)`` queries and (unit) keys.
      v: ``(B, T, H, d_v)`` values.
      erase: ``(B, T, H, d_k)`` erase gates in (0, 1).
      write: ``(B, T, H, d_v)`` write gates in (0, 1).
      log_decay: ``(B, T, H, d_k)`` log forget factors, ``< 0``.
      initial_state: ``(B, H, d_v, d_k)``; ``None`` means zeros.
      chunk_size: tokens per parallel chunk (compute only); ``None`` = fastest, 1 = per token.
      scale: read scale; ``None`` means ``1 / sqrt(d_k)``.
      starts, start_state: packed documents, as in :func:`nested.ops.linear_attention`.

    Returns:
      ``(o (B, T, H, d_v), final_state (B, H, d_v, d_k))``.
    """
    b, t, h, dk, dv = validation.check_qkv(q, k, v)
    validation.check_shape("erase", erase, (b, t, h, dk), "(B, T, H, d_k)")
    validation.check_shape("write", write, (b, t, h, dv), "(B, T, H, d_v)")
    validation.check_shape("log_decay", log_decay, (b, t, h, dk), "(B, T, H, d_k)")
    validation.check_state(initial_state, b, h, dv, dk)
    validation.check_int("chunk_size", chunk_size, optional=True)
    validation.check_documents(starts, start_state, b, t, h, dv, dk)
    if scale is None:
        scale = dk**-0.5
    u = jnp.sqrt(erase) * k
    size = chunk_size or default_chunk_size(key_decay=True)
    return delta_family(
        q * scale,
        u,
        write * v,
        jnp.ones((b, t, h), u.dtype),
        log_decay,
        key_decay=True,
        erase_after_decay=True,
        initial_state=initial_state,
        chunk_size=size,
        starts=starts,
        initial=start_state,
    )
