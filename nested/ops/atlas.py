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

Packed documents (``starts``): each document runs as if alone from ``start_state``, its window
at first the one it started with (``nested.ops.chunk_scan``, ``nested.ops.documents``).

Chunked form: all gradients of a chunk at its start theta_s (mini-batch semantics, as Titans).
Without Muon the state stays linear in the gradients and is read through the dual form; with
Muon the per-token momenta S_t of a chunk are formed (in parallel) and orthogonalised, as the
paper's parallel training does, so a chunk holds C copies of the parameters (rematerialised).
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops import chunk_coefficients as cc
from nested.ops import chunk_scan as cs
from nested.ops import documents, validation
from nested.ops import mlp_memory as mm
from nested.ops.functions import newton_schulz, polynomial_features  # noqa: F401 - re-exported


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


def _muon_step(carry: cs.ScanCarry, chunk: cs.ChunkInputs, *, form, read, window, steps):
    """One chunk with Muon: the per-token momenta formed from the factors, orthogonalised,

        S_t = P_t S_s - sum_i Lambda_{t,i} grad l_i(theta_s),
        theta_t = A_t theta_s + sum_{r <= t} D^alpha_{t,r} h_r NS_K(S_r)

    (``chunk_coefficients``). chunk: (B, H, C, ...). Returns (carry, o (B, H, C, d_v)).
    With documents every segment (``nested.ops.documents``) runs from its own base, as in
    ``chunk_scan.by_segments``; the tokens' own states give the end state directly."""
    k, v, band, _, prefix = cs.window_samples(carry.prefix, chunk, window, carry.window0)
    seg = None if chunk.starts is None else documents.segments(chunk.begins, chunk.starts)
    coef = cc.coefficients(chunk.step_in, chunk.mom, chunk.keep, band, seg)
    lam, mom_base = coef.lam, coef.mom_base

    def per_token(p, s, x, d):
        grad_w = jnp.einsum("bhtn,bhno,bhni->bhtoi", lam, d, x)
        s_t = {"w": mom_base[..., None, None] * s["w"][:, :, None] - grad_w}
        u_t = {"w": newton_schulz(s_t["w"], steps)}
        if "b" in p:
            s_t["b"] = mom_base[..., None] * s["b"][:, :, None] - jnp.einsum(
                "bhtn,bhno->bhto", lam, d
            )
            u_t["b"] = s_t["b"]
        theta_t = {
            name: cc.scale_rows(coef.base, p[name][:, :, None])
            + cc.accumulate(coef.keep, cc.scale_rows(chunk.step_out, u_t[name]))
            for name in p
        }
        return s_t, theta_t

    def run(at, params, momentum):  # (S_t, theta_t, o) of every token from one base
        grads = mm.sample_grads(at, k, v, form)
        states = [per_token(*layer) for layer in zip(params, momentum, *grads, strict=True)]
        s_t, theta_t = tuple(s for s, _ in states), tuple(t for _, t in states)
        o = mm.mlp_apply(theta_t if read == "after_write" else at, chunk.q, form)
        return s_t, theta_t, o

    last = lambda tree: jax.tree.map(lambda x: x[:, :, -1], tree)
    if seg is None:
        s_t, theta_t, o = run(carry.params, carry.params, carry.momentum)
        return carry._replace(params=last(theta_t), momentum=last(s_t), prefix=prefix), o
    state, start = (carry.params, carry.momentum), carry.restart
    at = carry.params if carry.at is None else carry.at
    first = run(at, *state)  # every row's chunk begins with it (``cs.at_chunk_start``)
    later = cs.needed(~seg.first & ~seg.second, lambda: run(start[0], *start))
    mid = start
    if carry.at is not None:  # the running document's next mini-batch may begin in the chunk

        def next_period():  # from the state after the first segment
            row = (jnp.sum(seg.first, axis=(1, 2)) - 1).reshape(-1, 1, 1)
            index = lambda x: row.reshape(row.shape + (1,) * (x.ndim - 3))
            token = lambda x: jnp.take_along_axis(x, index(x), 2)
            after = jax.tree.map(lambda x: token(x)[:, :, 0], (first[1], first[0]))
            return after, run(after[0], *after)

        mid, second = cs.needed(seg.second, next_period)
        later = documents.select(seg.second, second, later)
    s_t, theta_t, o = documents.select(seg.first, first, later)
    new = carry._replace(params=last(theta_t), momentum=last(s_t), prefix=prefix)
    if carry.at is not None:
        base = documents.pick(seg.first, state, documents.pick(seg.second, mid, start))
        new = new._replace(at=documents.pick(seg.first, at, base[0]))
    return new, o


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
    starts: jax.Array | None = None,
    start_state: AtlasState | None = None,
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
      starts: (B, T) bool, True where a new document starts (as in ``titans``): each document
        runs as if alone, the first from ``state``, every later one from ``start_state`` (like
        ``state``: with its window of samples), its chunks counted from its start.
    Returns:
      o (B, T, H, d_v) and the final ``AtlasState`` (its window the last document's).
    """
    validation.check_activation(activation)
    b, t, h, d_k, d_v = validation.check_sequence(q, k, v)
    validation.check_gates(b, t, h, lr=lr, momentum=momentum, decay=decay, gates=gates)
    validation.check_int("chunk_size", chunk_size)
    validation.check_read(read)
    validation.check_int("window", window)
    validation.check_int("muon_steps", muon_steps, 0)
    phi = (lambda x: x) if feature_map is None else feature_map
    d_phi = jax.eval_shape(phi, jax.ShapeDtypeStruct(k.shape[-1:], k.dtype)).shape[-1]
    validation.check_memory_state(
        state, b=b, h=h, d_in=d_phi, d_out=d_v, residual_norm=residual_norm
    )
    if not isinstance(state, AtlasState):
        state = atlas_state(state[0], window=window, d_k=d_k, momentum=state[1])
    validation.check_window_buffer(state, b=b, h=h, window=window, d_k=d_k, d_v=d_v)
    if start_state is not None and not isinstance(start_state, AtlasState):
        start_state = atlas_state(start_state[0], window=window, d_k=d_k, momentum=start_state[1])
    validation.check_starts(starts, start_state, b, t, like=state)
    form = mm.make_form(activation, residual_norm, norm_eps)
    dtype = jnp.result_type(q, k, v, lr, momentum, decay, gates, *jax.tree.leaves(tuple(state)))
    state = cs.cast(state, dtype)
    q, k, v, lr, momentum, decay, gates = cs.cast((q, k, v, lr, momentum, decay, gates), dtype)
    seq = cs.ChunkInputs(
        phi(q), phi(k), v, jnp.ones_like(lr), step_out=lr, mom=momentum, keep=1 - decay, gate=gates
    )
    window_of = lambda s: cs.Samples(phi(s.keys), s.values, s.gates) if window > 1 else None
    carry = cs.ScanCarry(tuple(state.params), tuple(state.momentum), window_of(state))
    if starts is not None:
        start_state = cs.cast(AtlasState(*start_state), dtype)
        restart = (tuple(start_state.params), tuple(start_state.momentum))
        carry = carry._replace(restart=restart, window0=window_of(start_state))
    seq = seq._replace(starts=starts)
    if muon_steps:
        carry, seq = cs.with_documents(carry, seq, chunk_size=chunk_size, window=window)
        step = partial(_muon_step, form=form, read=read, window=window, steps=muon_steps)
        o, final = cs.scan_documents(step, carry, seq, chunk_size=chunk_size)
    else:
        o, final = cs.scan_rule(
            carry, seq, chunk_size=chunk_size, form=form, read=read, window=window
        )
    if window == 1:
        return o, AtlasState(final.params, final.momentum, state.keys, state.values, state.gates)
    # The buffer for the next call: samples t - c + 1 .. t - 1 of [start's; old; sequence]
    # (rows c - 1 + t + s); with documents, where one precedes the last document's start, the
    # entry of the window that document started with (``documents.window_rows``).
    slot = np.arange(window - 1)[None]
    rows = jnp.broadcast_to(window - 1 + t + slot, (b, window - 1))
    first = state
    if starts is not None:
        offset = documents.offsets(starts)[:, -1:] + 1  # (B, 1): of the position after the last
        rows, first = jnp.where(window - 1 - slot > offset, offset + slot, rows), start_state

    def tail(start, old, new):
        samples = jnp.concatenate([start, old, jnp.moveaxis(new, 1, 2)], axis=2)
        index = rows.reshape(b, 1, window - 1, *(1,) * (samples.ndim - 3))
        return jnp.take_along_axis(samples, index, axis=2)

    return o, AtlasState(
        final.params,
        final.momentum,
        tail(first.keys, state.keys, k),
        tail(first.values, state.values, v),
        tail(first.gates, state.gates, gates),
    )
