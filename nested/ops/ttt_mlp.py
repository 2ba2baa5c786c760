"""TTT-MLP: mini-batch test-time training of an MLP memory, dual form.

Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States". The
hidden state is the memory's parameters theta (``nested.ops.mlp_memory``), trained online on

    l_t(theta) = 1/2 |f_theta(k_t) - v_t|^2.

Mini-batch TTT with chunk (mini-batch) size C: in a chunk starting at theta_s every gradient is
taken at theta_s, and the state after token t is

    theta_t = theta_s - sum_{j <= t in chunk} lr_j grad l_j(theta_s),     o_t = f_{theta_t}(q_t),

read with the dual form (masked matmuls over the chunk; theta_t is never formed). With
chunk_size=1 it is online gradient descent (for a depth-1 memory: the delta rule).
"""

import jax
import jax.numpy as jnp

from nested.ops import chunk_scan as cs
from nested.ops import mlp_memory as mm
from nested.ops import validation


def ttt_mlp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lr: jax.Array,
    *,
    params: mm.Params,
    chunk_size: int = 16,
    activation="gelu",
    residual_norm: bool = False,
    norm_eps: float = 1e-6,
    clip: float | None = None,
    starts: jax.Array | None = None,
    start_params: mm.Params | None = None,
) -> tuple[jax.Array, mm.Params]:
    """Mini-batch TTT on an MLP memory.

    Args:
      q, k: (B, T, H, d_k) queries and keys; v: (B, T, H, d_v) targets.
      lr: (B, T, H) inner step sizes.
      params: initial memory (tuple of layers with leading (B, H); ``init_mlp_memory``).
      chunk_size: mini-batch size C; T need not be a multiple of it. Mini-batches start at the
        call's first token: a stream split across calls continues exactly when split at
        multiples of C; a last, partial mini-batch is applied to the returned state
        (``nested.ops.stream`` cuts a stream anywhere).
      activation: hidden activation name (``mlp_memory.ACTIVATIONS``) or callable.
      residual_norm: use f(x) = x + LN(MLP(x)) (needs d_k == d_v).
      clip: the largest norm of one token's gradient, or None (``rules.GradientDescent``'s
        clip, ``mlp_memory.clipped``); needs chunk_size > 1.
      starts: (B, T) bool, True where a new document starts (packed documents, as in
        ``nested.ops.linear_attention``): each document runs as if alone, the first from
        ``params``, every later one from ``start_params``, its mini-batches counted from its
        start.
    Returns:
      o (B, T, H, d_v) read after each token's write, and the final params.
    """
    validation.check_activation(activation)
    b, t, h, d_k, d_v = validation.check_sequence(q, k, v)
    validation.check_gates(b, t, h, lr=lr)
    validation.check_int("chunk_size", chunk_size)
    validation.check_clip(clip, chunk_size)
    validation.check_params(
        params, b=b, h=h, d_in=d_k, d_out=d_v, residual_norm=residual_norm, name="params"
    )
    validation.check_starts(starts, start_params, b, t, like=params, name="start_params")
    form = mm.make_form(activation, residual_norm, norm_eps)
    dtype = jnp.result_type(q, k, v, lr, *jax.tree.leaves(params))
    seq = cs.cast(cs.ChunkInputs(q, k, v, step_in=lr), dtype)._replace(starts=starts)
    restart = None if start_params is None else (cs.cast(tuple(start_params), dtype), None)
    carry = cs.ScanCarry(cs.cast(tuple(params), dtype), None, None, restart=restart)
    o, final = cs.scan_rule(
        carry, seq, chunk_size=chunk_size, form=form, read="after_write", window=1, clip=clip
    )
    return o, final.params
