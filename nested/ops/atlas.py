"""ATLAS: Omega-rule memory over a sliding window, polynomial key features, Muon inner optimizer.

Behrouz et al. 2025, "ATLAS: Learning to Optimally Memorize the Context at Test Time". Per token,
with data-dependent h_t (step), m_t (momentum retention), a_t (forgetting) and sample gates g_i,
all in [0, 1]:

    L_t(theta) = sum_{i = t-c+1 .. t} g_i 1/2 |f_theta(phi(k_i)) - v_i|^2       (Omega rule)
    S_t        = m_t S_{t-1} - grad L_t(theta_{t-1})
    theta_t    = (1 - a_t) theta_{t-1} + h_t NS_K(S_t)

Gates: the paper's gamma_{t,i} is parametrised by one gate per sample, gamma_{t,i} = g_i, applied
to sample i in every window containing it. The window reaches into the previous call through the
state's buffer of the last c - 1 (key, value, gate) triples (zero gates at a sequence start: the
window holds only the available samples). phi acts on keys and queries (``feature_map``; None =
identity; ``polynomial_features``). NS_K is K Newton-Schulz iterations with Muon's quintic
coefficients on every matrix-shaped parameter (biases take the momentum as is); K = 0 is the
identity. Sign convention: S is a descent direction like Titans' (the paper's S is -S here;
NS is odd, so the dynamics are the same).

Relation to Titans: with c = 1, phi = None, K = 0 this is ``titans`` with the step applied after
the momentum instead of inside it; the two are the same when h is constant in time
(S_titans = h S_atlas) or when m = 0.

Chunked form: all gradients of a chunk at its start theta_s (mini-batch semantics, as Titans).
Without Muon the state stays linear in the gradients and is read through the dual form; with
Muon the per-token momenta S_t of a chunk are formed (in parallel) and orthogonalised, as the
paper's parallel training does, so a chunk holds C copies of the parameters (rematerialised).
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested.learn.memories import polynomial_features  # noqa: F401 - re-exported by nested.ops
from nested.learn.rules import newton_schulz
from nested.ops import mlp_memory as mm
from nested.ops import neural_chunk as nc
from nested.ops.titans import check_state


class AtlasState(NamedTuple):
    """Memory params, momentum S, and the last window - 1 samples: keys (B, H, c-1, d_k) (raw,
    before phi), values (B, H, c-1, d_v), gates (B, H, c-1)."""

    params: mm.Params
    momentum: mm.Params
    keys: jax.Array
    values: jax.Array
    gates: jax.Array


def atlas_state(params: mm.Params, *, window: int, d_k: int, momentum=None) -> AtlasState:
    """A fresh ATLAS state: zero momentum (unless given) and an empty window (zero gates)."""
    params = tuple(params)
    w_last = params[-1]["w"]
    batch, heads, d_v = w_last.shape[:3]
    buf = (batch, heads, window - 1)
    if momentum is None:
        momentum = jax.tree.map(jnp.zeros_like, params)
    return AtlasState(
        params,
        tuple(momentum),
        jnp.zeros((*buf, d_k), w_last.dtype),
        jnp.zeros((*buf, d_v), w_last.dtype),
        jnp.zeros(buf, w_last.dtype),
    )


def _muon_step(carry, xs, *, form: mm.MemoryForm, read: str, window: int, steps: int):
    """One chunk with Muon: per-token momenta S_t formed from the factors, then orthogonalised."""
    params, momentum, prefix = carry
    k, v, band, prefix = nc.window_samples(prefix, xs, window)
    inputs, deltas = mm.sample_grads(params, k, v, form)
    coef = nc.coefficients(xs, band)
    lam, mom_base, step = coef["lam"], coef["mom_base"], xs["step_out"]

    def per_token(p, s, x, d):
        grad_w = jnp.einsum("bhtn,bhno,bhni->bhtoi", lam, d, x)
        s_t = {"w": mom_base[..., None, None] * s["w"][:, :, None] - grad_w}
        u_t = {"w": newton_schulz(s_t["w"], steps)}
        if "b" in p:
            s_t["b"] = mom_base[..., None] * s["b"][:, :, None] - jnp.einsum(
                "bhtn,bhno->bhto", lam, d
            )
            u_t["b"] = s_t["b"]
        # theta_t = A_t theta_s + sum_r D^alpha_{t,r} h_r U_r
        theta_t = {
            name: nc.scale_rows(coef["base"], p[name][:, :, None])
            + nc.accumulate(coef["keep"], nc.scale_rows(step, u_t[name]))
            for name in p
        }
        return s_t, theta_t

    states = [per_token(*layer) for layer in zip(params, momentum, inputs, deltas, strict=True)]
    s_t = tuple(s for s, _ in states)
    theta_t = tuple(t for _, t in states)
    o = mm.mlp_apply(theta_t if read == "after_write" else params, xs["q"], form)
    last = lambda tree: jax.tree.map(lambda x: x[:, :, -1], tree)
    return (last(theta_t), last(s_t), prefix), o


def atlas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lr: jax.Array,
    momentum: jax.Array,
    decay: jax.Array,
    gates: jax.Array,
    *,
    state: AtlasState | tuple,
    window: int = 1,
    chunk_size: int = 16,
    feature_map=None,
    muon_steps: int = 0,
    read: str = "after_write",
    activation="gelu",
    residual_norm: bool = False,
    norm_eps: float = 1e-6,
) -> tuple[jax.Array, AtlasState]:
    """ATLAS memory over a sequence (chunked; chunk_size=1 is the online rule).

    Args:
      q, k: (B, T, H, d_k); v: (B, T, H, d_v).
      lr, momentum, decay, gates: (B, T, H) h_t, m_t, a_t and the Omega sample gates g_t.
      state: ``AtlasState`` or (params, momentum) for an empty window; the memory's input dim
        is phi's output dim.
      window: Omega window c >= 1. feature_map: phi on the last axis, or None.
      chunk_size: C, as in ``titans`` (chunks start at the call's first token; a stream split
        across calls continues exactly at multiples of C; ``nested.ops.stream`` cuts anywhere).
      muon_steps: Newton-Schulz iterations K (0: plain momentum).
      read: "after_write" (o_t = f_{theta_t}(phi(q_t))) or "chunk_start" (theta at the start of
        t's chunk), as in ``titans``.
    Returns:
      o (B, T, H, d_v) and the final ``AtlasState``.
    """
    form = mm.make_form(activation, residual_norm, norm_eps)
    gate_arrays = {"lr": lr, "momentum": momentum, "decay": decay, "gates": gates}
    batch, _, heads = nc.check_sequence(q, k, v, gate_arrays, chunk_size)
    nc.check_read(read)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}.")
    if isinstance(muon_steps, bool) or not isinstance(muon_steps, int) or muon_steps < 0:
        raise ValueError(f"muon_steps must be an int >= 0, got {muon_steps!r}.")
    phi = (lambda x: x) if feature_map is None else feature_map
    d_phi = jax.eval_shape(phi, jax.ShapeDtypeStruct(k.shape[-1:], k.dtype)).shape[-1]
    check_state(state, batch=batch, heads=heads, d_in=d_phi, d_out=v.shape[-1], form=form)
    if not isinstance(state, AtlasState):
        state = atlas_state(state[0], window=window, d_k=k.shape[-1], momentum=state[1])
    buf = (batch, heads, window - 1)
    if (
        state.keys.shape != (*buf, k.shape[-1])
        or state.values.shape != (*buf, v.shape[-1])
        or (state.gates.shape != buf)
    ):
        raise ValueError(
            f"state window buffer has keys {state.keys.shape}, values {state.values.shape}, gates "
            f"{state.gates.shape}; window={window} needs {(*buf, k.shape[-1])}, "
            f"{(*buf, v.shape[-1])}, {buf}. Build it with atlas_state(params, window=...)."
        )
    dtype = jnp.result_type(q, k, v, *gate_arrays.values(), *jax.tree.leaves(tuple(state)))
    state = nc.cast(state, dtype)
    q, k, v, lr, momentum, decay, gates = nc.cast((q, k, v, lr, momentum, decay, gates), dtype)
    seq = {
        "q": phi(q),
        "k": phi(k),
        "v": v,
        "step_in": jnp.ones_like(lr),
        "step_out": lr,
        "mom": momentum,
        "keep": 1 - decay,
        "gate": gates,
    }
    prefix = {"k": phi(state.keys), "v": state.values, "gate": state.gates} if window > 1 else None
    carry = (tuple(state.params), tuple(state.momentum), prefix)
    if muon_steps:
        step = partial(_muon_step, form=form, read=read, window=window, steps=muon_steps)
        o, (params, mom, _) = nc.scan_chunks(step, carry, seq, chunk_size=chunk_size)
    else:
        o, (params, mom, _) = nc.scan_rule(
            carry, seq, chunk_size=chunk_size, form=form, read=read, window=window
        )
    # The buffer for the next call: the last c - 1 samples (raw keys) of old buffer + sequence.
    tail = lambda old, new: jnp.concatenate([old, jnp.moveaxis(new, 1, 2)], axis=2)[
        :, :, old.shape[2] + new.shape[1] - (window - 1) :
    ]
    return o, AtlasState(
        params, mom, tail(state.keys, k), tail(state.values, v), tail(state.gates, gates)
    )
