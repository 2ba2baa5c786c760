"""TTT-Linear's inner loop: mini-batch gradient descent on a linear memory, in dual form.

The memory ``f_W(k) = W k`` learns ``1/2 |W k_t - v_t|^2`` at test time with step sizes ``lr_t``.
Mini-batch TTT with batch size ``b = chunk_size``: inside a mini-batch that starts at ``W_s``
every gradient is taken at ``W_s``, and the state after token ``t`` of the mini-batch is

    W_t = W_s - sum_{j <= t, j in batch} lr_j (W_s k_j - v_j) k_j^T,   o_t = scale * W_t q_t;

the mini-batch's last state starts the next one (a final partial mini-batch is shorter). The dual
form computes all ``o_t`` of a mini-batch with masked matmuls and never materialises a ``W_t``
per token (:func:`nested.ops.chunked.delta_family` with ``exact=False``). Here ``chunk_size`` is
semantic; ``chunk_size=1`` is online SGD, i.e. :func:`nested.ops.delta_rule` with ``beta = lr``.
The paper's residual connection and LayerNorm around ``f_W`` belong to the layer.

Reference: Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
States".
"""

from nested.ops import validation
from nested.ops.chunked import delta_family


def ttt_linear(q, k, v, lr, *, initial_state, chunk_size, scale=1.0, starts=None, start_state=None):
    """Mini-batch TTT-Linear (see the module docstring for the equation).

    Args:
      q, k: ``(B, T, H, d_k)`` queries and keys (TTT's test and training views).
      v: ``(B, T, H, d_v)`` targets (TTT's label view).
      lr: ``(B, T, H)`` inner-loop step sizes.
      initial_state: ``(B, H, d_v, d_k)`` starting weights ``W_0`` (usually learned); ``None``
        means zeros.
      chunk_size: mini-batch size ``b`` (semantic; mini-batches start at the call's first
        token, so a stream split across calls continues exactly at multiples of ``b``;
        ``nested.ops.stream`` cuts a stream anywhere).
      scale: read scale.
      starts, start_state: packed documents, as in :func:`nested.ops.linear_attention`; each
        document's mini-batches are counted from its start.

    Returns:
      ``(o (B, T, H, d_v), final_state (B, H, d_v, d_k))``.
    """
    b, t, h, dk, dv = validation.check_qkv(q, k, v)
    validation.check_shape("lr", lr, (b, t, h), "(B, T, H)")
    validation.check_state(initial_state, b, h, dv, dk)
    validation.check_int("chunk_size", chunk_size)
    validation.check_documents(starts, start_state, b, t, h, dv, dk)
    return delta_family(
        q * scale,
        k,
        lr[..., None] * v,
        lr,
        None,
        exact=False,
        initial_state=initial_state,
        chunk_size=chunk_size,
        starts=starts,
        initial=start_state,
    )
