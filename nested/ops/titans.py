"""Titans neural memory: gradient steps with momentum ("surprise") and forgetting.

Behrouz, Zhong, Mirrokni 2025, "Titans: Learning to Memorize at Test Time". Per token, with
data-dependent m_t (momentum retention), h_t (step size), a_t (forgetting), all in [0, 1]:

    S_t     = m_t S_{t-1} - h_t grad L_t(theta_{t-1})
    theta_t = (1 - a_t) theta_{t-1} + S_t
    L_t(theta) = 1/2 |f_theta(k_t) - v_t|^2

The paper's loss has no 1/2: its step h equals 2 h here. Chunked (mini-batch) form, chunk C:
every gradient of a chunk is taken at its start theta_s; momentum and decay stay exact linear
recurrences over the chunk, computed in parallel (``nested.ops.chunk_coefficients``). Reads:

- ``read="after_write"``: o_t = f_{theta_t}(q_t), theta_t the state after token t's write
  (dual form, as TTT). chunk_size=1 is the exact online recurrence.
- ``read="chunk_start"``: o_t = f_{theta_s}(q_t), the state at the start of t's chunk, as
  titans-pytorch retrieves. With chunk_size=1 this reads theta_{t-1}, before t's write.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested.ops import chunk_scan as cs
from nested.ops import mlp_memory as mm
from nested.ops import validation


class TitansState(NamedTuple):
    """Memory parameters theta and momentum S, params-shaped pytrees with leading (B, H)."""

    params: mm.Params
    momentum: mm.Params


def titans_state(params: mm.Params, momentum: mm.Params | None = None) -> TitansState:
    """A Titans state; momentum defaults to zeros."""
    params = tuple(params)
    if momentum is None:
        momentum = jax.tree.map(jnp.zeros_like, params)
    return TitansState(params, tuple(momentum))


def titans(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lr: jax.Array,
    momentum: jax.Array,
    decay: jax.Array,
    *,
    state: TitansState,
    chunk_size: int = 16,
    read: str = "after_write",
    activation="gelu",
    residual_norm: bool = False,
    norm_eps: float = 1e-6,
    clip: float | None = None,
    starts: jax.Array | None = None,
    start_state: TitansState | None = None,
) -> tuple[jax.Array, TitansState]:
    """Titans memory over a sequence (chunked; chunk_size=1 is the online rule).

    Args:
      q, k: (B, T, H, d_k); v: (B, T, H, d_v).
      lr: (B, T, H) step size h_t; momentum: (B, T, H) retention m_t; decay: (B, T, H) a_t.
      state: initial ``TitansState`` (params, momentum S), e.g. ``titans_state(params)``.
      chunk_size: C; T need not be a multiple of it. Chunks start at the call's first token:
        a stream split across calls (state carried) continues exactly when split at
        multiples of C; a last, partial chunk is applied to the returned state
        (``nested.ops.stream`` cuts a stream anywhere).
      read: "after_write" or "chunk_start" (module docstring).
      activation, residual_norm, norm_eps: the memory network (``nested.ops.mlp_memory``).
      clip: the largest norm of one token's gradient, or None (``rules.GradientDescent``'s
        clip, ``mlp_memory.clipped``); needs chunk_size > 1.
      starts: (B, T) bool, True where a new document starts (packed documents, as in
        ``nested.ops.linear_attention``): each document runs as if alone, the first from
        ``state``, every later one from ``start_state``, its chunks counted from its start.
    Returns:
      o (B, T, H, d_v) and the final ``TitansState``.
    """
    validation.check_activation(activation)
    b, t, h, d_k, d_v = validation.check_sequence(q, k, v)
    validation.check_gates(b, t, h, lr=lr, momentum=momentum, decay=decay)
    validation.check_int("chunk_size", chunk_size)
    validation.check_clip(clip, chunk_size)
    validation.check_read(read)
    validation.check_memory_state(state, b=b, h=h, d_in=d_k, d_out=d_v, residual_norm=residual_norm)
    validation.check_starts(starts, start_state, b, t, like=state[:2])
    form = mm.make_form(activation, residual_norm, norm_eps)
    dtype = jnp.result_type(q, k, v, lr, momentum, decay, *jax.tree.leaves(tuple(state[:2])))
    # step_out = 1 marks real tokens: padding (0) must not add the carried momentum again.
    seq = cs.ChunkInputs(q, k, v, lr, step_out=jnp.ones_like(lr), mom=momentum, keep=1 - decay)
    restart = None if start_state is None else cs.cast(tuple(map(tuple, start_state[:2])), dtype)
    carry = cs.ScanCarry(*cs.cast((tuple(state[0]), tuple(state[1])), dtype), None, restart=restart)
    o, final = cs.scan_rule(
        carry,
        cs.cast(seq, dtype)._replace(starts=starts),
        chunk_size=chunk_size,
        form=form,
        read=read,
        window=1,
        clip=clip,
    )
    return o, TitansState(final.params, final.momentum)
