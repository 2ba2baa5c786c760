"""Titans neural memory: gradient steps with momentum ("surprise") and forgetting.

Behrouz, Zhong, Mirrokni 2025, "Titans: Learning to Memorize at Test Time". Per token, with
data-dependent m_t (momentum retention), h_t (step size), a_t (forgetting), all in [0, 1]:

    S_t     = m_t S_{t-1} - h_t grad L_t(theta_{t-1})
    theta_t = (1 - a_t) theta_{t-1} + S_t
    L_t(theta) = 1/2 |f_theta(k_t) - v_t|^2

The paper's loss has no 1/2: its step h equals 2 h here. Chunked (mini-batch) form, chunk C:
every gradient of a chunk is taken at its start theta_s; momentum and decay stay exact linear
recurrences over the chunk, computed in parallel (``nested.ops.neural_chunk``). Reads:

- ``read="after_write"``: o_t = f_{theta_t}(q_t), theta_t the state after token t's write
  (dual form, as TTT). chunk_size=1 is the exact online recurrence.
- ``read="chunk_start"``: o_t = f_{theta_s}(q_t), the state at the start of t's chunk, as
  titans-pytorch retrieves. With chunk_size=1 this reads theta_{t-1}, before t's write.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested.ops import mlp_memory as mm
from nested.ops import neural_chunk as nc


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


def check_state(state, *, batch, heads, d_in, d_out, form) -> None:
    """Validate (params, momentum) of a momentum rule."""
    if not isinstance(state, tuple) or len(state) < 2:
        raise ValueError("state must be (params, momentum), e.g. nested.ops.titans_state(params).")
    mm.check_params(
        state[0], batch=batch, heads=heads, d_in=d_in, d_out=d_out, form=form, name="state.params"
    )
    shapes = lambda tree: jax.tree.map(jnp.shape, tuple(tree))
    if jax.tree.structure(tuple(state[0])) != jax.tree.structure(tuple(state[1])) or shapes(
        state[0]
    ) != shapes(state[1]):
        raise ValueError("state.momentum must have the structure and shapes of state.params.")


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
    Returns:
      o (B, T, H, d_v) and the final ``TitansState``.
    """
    form = mm.make_form(activation, residual_norm, norm_eps)
    gates = {"lr": lr, "momentum": momentum, "decay": decay}
    batch, _, heads = nc.check_sequence(q, k, v, gates, chunk_size)
    nc.check_read(read)
    check_state(state, batch=batch, heads=heads, d_in=k.shape[-1], d_out=v.shape[-1], form=form)
    dtype = jnp.result_type(q, k, v, *gates.values(), *jax.tree.leaves(tuple(state[:2])))
    # step_out = 1 marks real tokens: padding (0) must not add the carried momentum again.
    seq = {"q": q, "k": k, "v": v, "step_in": lr, "mom": momentum, "keep": 1 - decay}
    seq["step_out"] = jnp.ones_like(lr)
    carry = nc.cast((tuple(state[0]), tuple(state[1])), dtype) + (None,)
    o, (params, mom, _) = nc.scan_rule(
        carry, nc.cast(seq, dtype), chunk_size=chunk_size, form=form, read=read, window=1
    )
    return o, TitansState(params, mom)
