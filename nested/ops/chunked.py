"""The delta-rule family of linear memories: one per-token scan and one chunkwise-parallel kernel.

Every linear memory of :mod:`nested.ops` (Hebbian, delta, gated delta, Falcon-1/2/3, GDN-2,
TTT-Linear) is an instance of one recurrence on a value-by-key state ``W (d_v, d_k)`` per batch
element and head. Token ``t`` writes the ``c`` key/value pairs of its window, slot ``m`` holding
``(k_{t-m}, w_t v_{t-m})`` (``c = 1`` except for Falcon-3's sliding window; pairs before the start
of the sequence are zero):

    W_t = Dec_t(W_{t-1}) + sum_m (w_t v_{t-m} - beta_t * Dec'_t(W_{t-1}) k_{t-m}) k_{t-m}^T
    o_t = W_t q_t

``Dec_t`` multiplies by ``gamma_t = exp(log_decay_t)``: a scalar per head ``(B, T, H)``, one
factor per row ``(B, T, H, d_v)`` (Falcon-2) or per key column ``(B, T, H, d_k)`` (GDN-2,
``key_decay=True``). ``Dec'_t = Dec_t`` when ``erase_after_decay`` (gated delta:
``a W (I - b k k^T)``) and the identity otherwise (Falcon: ``(1 - e l) W - e (W x) x^T``).
``beta`` and the write gain ``w`` are scalars per head or one per value row; ``beta=None`` drops
the erase term (Hebbian) and ``w=None`` means values already scaled by their write strength.

Chunkwise form (``exact=True``). In a chunk starting at state ``S`` with in-chunk cumulative
log-decay ``g_t`` (``g^e_t`` the same up to the erase point), the state is
``W_t = S Gamma_t + sum_{j<=t} u_j (k_j Gamma_t / Gamma_j)^T`` with pseudo-values ``u`` solving
the unit lower-triangular system

    u_t + sum_{j<t} beta_t <k_t, k_j>_{exp(g^e_t - g_j)} u_j = v_t - beta_t S (exp(g^e_t) k_t)

(``<a, b>_w`` = sum over key dims of ``a b w``; rows ``t, j`` are slots, strictly earlier
tokens couple). ``(I + A)^{-1}`` is formed by block doubling (:mod:`nested.ops.triangular`), then
outputs ``o_t = S (exp(g_t) q_t) + sum_{j<=t} <q_t, k_j>_{exp(g_t - g_j)} u_j`` and the next state
are masked matmuls. Every decay factor is an ``exp`` of a non-positive log-difference taken inside
the chunk, so strong decays underflow to 0 where the true factor does instead of overflowing;
key-wise decays split those factors at sub-block starts to keep the inner products matmuls
(:func:`_key_decayed_gram`). Only the state carry between chunks is sequential (a ``lax.scan``)
and each chunk step is rematerialised (``jax.checkpoint``), so the backward pass stores one state
per chunk and nothing per token: temporary memory grows linearly in ``T``. With ``exact=False``
the coupling ``A`` is dropped: every prediction reads the chunk-start state (mini-batch TTT's
dual form), so there the chunk size is semantic.

Packed documents (``starts``, :mod:`nested.ops.documents`; window 1): the chunks stay on the
sequence's grid and each is cut into segments at the starts (and, for mini-batches, where the
running document's next period begins). A token of a later segment reads its segment's base
state ``S'`` (``initial`` for a document) decayed from the segment's start, ``exp(g_t -
g_{s-1})``, and the couplings and scores above are masked to pairs of one segment, so ``A``
stays unit lower triangular (block diagonal) and one inverse serves every document of the
chunk; the end state continues the last segment's base by that segment's writes. Documents
declared on a grid the chunks divide (``documents.on_grid``) restart the state at a chunk's
first token instead, and every chunk runs without segments.

References: Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (WY/UT form); Yang, Kautz & Hatamizadeh 2025 (gated delta rule); Yang et al.
2024, "Gated Linear Attention" (secondary chunking for key-wise decays).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops import documents, loops
from nested.ops.triangular import unit_lower_inverse

# Chunk lengths of ``chunk_size=None``: the fastest exact ones on XLA:CPU (2 cores), measured
# with benchmarks/ops_throughput.py --chunks (B=4, H=4, d=64, T=4096). Without an erase term
# (Hebbian) a chunk is a few matmuls and longer chunks win; 16 to 64 are within noise of each
# other for scalar gates (32 also keeps memory low); per-row gates (Falcon-2) repeat the (L, L)
# work for every value row and key-wise decays (GDN-2) form pairwise factors, so both prefer
# short chunks.
DEFAULT_CHUNK_HEBBIAN = 64
DEFAULT_CHUNK = 32
DEFAULT_CHUNK_ROW_GATES = 16
DEFAULT_CHUNK_KEY_DECAY = 16
SUB_BLOCK = 4  # tokens per sub-block of key-wise decays (pairwise inside, matmuls across)


def default_chunk_size(
    *, erase: bool = True, row_gates: bool = False, key_decay: bool = False, slots: int = 1
) -> int:
    """The chunk length ``chunk_size=None`` resolves to; ``slots`` key/value slots per token
    multiply the rows of a chunk, so the chunk is shortened by that factor."""
    if not erase:
        size = DEFAULT_CHUNK_HEBBIAN
    elif key_decay:
        size = DEFAULT_CHUNK_KEY_DECAY
    elif row_gates:
        size = DEFAULT_CHUNK_ROW_GATES
    else:
        size = DEFAULT_CHUNK
    return max(1, size // slots)


def delta_family(
    q,
    k,
    v,
    beta,
    log_decay,
    *,
    write=None,
    window: int = 1,
    key_decay: bool = False,
    erase_after_decay: bool = True,
    exact: bool = True,
    initial_state=None,
    chunk_size: int,
    starts=None,
    initial=None,
):
    """Runs the general rule of this module over a sequence.

    Args:
      q: ``(B, T, H, d_k)`` queries (already multiplied by the read scale).
      k: ``(B, T, H, d_k)`` keys.
      v: ``(B, T, H, d_v)`` values.
      beta: ``None``, ``(B, T, H)`` or ``(B, T, H, d_v)`` erase strengths.
      log_decay: ``None``, ``(B, T, H)``, ``(B, T, H, d_v)`` or, with ``key_decay``,
        ``(B, T, H, d_k)`` log retention factors (``<= 0`` for a contraction).
      write: ``None`` (values are used as given), ``(B, T, H)`` or ``(B, T, H, d_v)`` gains
        ``w_t`` of the values written at token ``t``.
      window: the number ``c`` of recent key/value pairs each token writes.
      key_decay: whether ``log_decay`` runs over key columns instead of value rows.
      erase_after_decay: whether the erase term reads the decayed state.
      exact: ``False`` gives mini-batch semantics (predictions read the chunk-start state).
      initial_state: ``None`` (zeros) or ``(B, H, d_v, d_k)``.
      chunk_size: tokens per chunk; 1 runs the per-token ``lax.scan``. With ``exact=False`` it
        is the mini-batch.
      starts: ``None`` or ``(B, T)`` bool, True where a new document starts
        (``nested.ops.documents``): each document runs as if alone, the first from
        ``initial_state``, every later one from ``initial``, its mini-batches counted from its
        start (``window`` must be 1; with ``exact=False`` there is no ``log_decay``).
      initial: ``(B, H, d_v, d_k)``, the state every document after the first starts from.

    Returns:
      ``o (B, T, H, d_v)`` and the final state ``(B, H, d_v, d_k)``, in the inputs' dtype.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    # Scalar gates become one-row gates so that scalar and per-row gates share every formula.
    beta, log_decay, write = (
        None if x is None else _as_rows(x.astype(dtype)) for x in (beta, log_decay, write)
    )
    state = jnp.zeros((b, h, dv, dk), dtype) if initial_state is None else initial_state
    state = state.astype(dtype)
    if starts is not None:
        if window != 1 or (log_decay is not None and not exact):
            raise ValueError("document starts need window=1, and no decay with exact=False")
        initial = initial.astype(dtype)
    if chunk_size == 1:
        k_slots, v_slots = _window(k, window), _window(v, window)  # (B, T, H, c, d)
        if write is not None:
            v_slots = write[..., None, :] * v_slots
        step = functools.partial(
            _token_step, key_decay=key_decay, after=erase_after_decay, initial=initial
        )
        xs = (q, k_slots, v_slots, beta, log_decay, starts)
        state, o = jax.lax.scan(step, state, jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs))
        return jnp.moveaxis(o, 0, 1), state
    # A chunk holds at least the window's c - 1 earlier tokens, which the next chunk reads.
    size = max(min(chunk_size, t), window - 1)
    step = functools.partial(
        _chunk_step,
        window=window,
        key_decay=key_decay,
        after=erase_after_decay,
        exact=exact,
        initial=initial,
    )
    xs = jax.tree.map(lambda x: _to_chunks(x, size), (q, k, v, write, beta, log_decay))
    halos = tuple(_halo(x, window - 1) for x in xs[1:3]) if window > 1 else (None, None)
    carry, docs = state, None
    on_grid = starts is not None and documents.on_chunks(chunk_size)
    if on_grid:  # every start at a chunk's first token: restart there, no segments
        docs = _to_chunks(starts[:, :, None, None], size)[:, :, 0, 0, 0]  # (N, B)
        step = functools.partial(_restarting, step=step, initial=initial)
    elif starts is not None:
        begins = starts if exact else documents.period_begins(starts, chunk_size)
        docs = tuple(_to_chunks(x[:, :, None, None], size)[..., 0] for x in (begins, starts))
        carry = state if exact else (state, state)
    carry, o = loops.remat_scan(step, carry, xs + halos + (docs,))
    o = jnp.moveaxis(o, 0, 2)  # (B, H, N, C, d_v)
    o = o.reshape(b, h, -1, dv)[:, :, :t]
    return jnp.swapaxes(o, 1, 2), carry if starts is None or exact or on_grid else carry[1]


def _restarting(carry, xs, *, step, initial):
    """``step`` of a chunk whose first token may start a document (``xs``'s last entry,
    ``(B,)``): those rows begin from ``initial``, and the chunk runs without segments."""
    *chunk, restart = xs
    return step(documents.choose(restart, initial, carry), (*chunk, None))


def _as_rows(gate):
    return gate[..., None] if gate.ndim == 3 else gate


def _window(x, c):
    """(B, T, H, d) -> (B, T, H, c, d): slot m holds x_{t-m}, zero before the sequence start."""
    if c == 1:
        return x[..., None, :]
    t = x.shape[1]
    padded = jnp.pad(x, ((0, 0), (c - 1, 0), (0, 0), (0, 0)))
    return jnp.stack([padded[:, c - 1 - m : c - 1 - m + t] for m in range(c)], axis=3)


def _halo(chunks, width):
    """(N, B, H, C, d) -> the last ``width`` tokens of the previous chunk (zeros for the first)."""
    previous = chunks[:-1, ..., chunks.shape[-2] - width :, :]
    first = jnp.zeros((1,) + previous.shape[1:], chunks.dtype)
    return jnp.concatenate([first, previous], axis=0)


def _window_rows(halo, x, c):
    """Chunk ``x (..., C, d)`` after ``halo (..., c - 1, d)`` -> (..., C c, d): row ``t c + m``
    holds token ``t - m``."""
    extended = jnp.concatenate([halo, x], axis=-2)
    size = x.shape[-2]
    slots = [extended[..., c - 1 - m : c - 1 - m + size, :] for m in range(c)]
    return jnp.stack(slots, axis=-2).reshape(x.shape[:-2] + (size * c, x.shape[-1]))


def _to_chunks(x, size):
    """(B, T, H, d) -> (N, B, H, C, d), padding T with inert zeros (no write, no decay)."""
    b, t, h, d = x.shape
    n = -(-t // size)
    x = jnp.pad(x, ((0, 0), (0, n * size - t), (0, 0), (0, 0)))
    return jnp.transpose(x.reshape(b, n, size, h, d), (1, 0, 3, 2, 4))


def _token_step(state, xs, *, key_decay, after, initial):
    """One token of the general rule, written as the equation (the ``chunk_size=1`` path); a
    token starting a document (``start`` (B,), None without documents) starts from
    ``initial``."""
    q, k, v, beta, log_decay, start = xs  # (B, H, d_k), (B, H, c, d_k), (B, H, c, d_v), (B, H, R)
    if start is not None:
        state = jnp.where(start[:, None, None, None], initial, state)
    decayed = state
    if log_decay is not None:
        gamma = jnp.exp(log_decay)
        decayed = state * (gamma[..., None, :] if key_decay else gamma[..., :, None])
    if beta is not None:
        read = decayed if after else state
        v = v - beta[..., None, :] * jnp.einsum("...vk,...mk->...mv", read, k)
    state = decayed + jnp.einsum("...mv,...mk->...vk", v, k)
    return state, jnp.einsum("...vk,...k->...v", state, q)


def _broadcast_mask(mask, ndim):
    return mask[(None,) * (ndim - mask.ndim)]


def _masked_exp(log_ratio, mask):
    """``exp`` where ``mask`` holds, exactly 0 elsewhere, with zero gradient off the mask."""
    mask = _broadcast_mask(mask, log_ratio.ndim)
    return jnp.where(mask, jnp.exp(jnp.where(mask, log_ratio, 0.0)), 0.0)


def _key_decayed_gram(a, b, log_a, log_b, block_start, block_end, mask):
    """``G_{rl} = sum_d a_{r,d} b_{l,d} exp(log_a_{r,d} - log_b_{l,d})`` on ``mask``, else 0.

    Rows ``a (..., R, d)`` and columns ``b (..., L, d)`` are grouped by token into sub-blocks
    whose first and last tokens have the cumulative log-decays ``block_start`` (exclusive) and
    ``block_end`` (inclusive), ``(..., n, d)``; the mask is causal, so a row only meets columns
    of its own or earlier sub-blocks. Between a row of block I and a column of an earlier block
    J the decay splits as ``exp(log_a - s_I) exp(s_I - e_J) exp(e_J - log_b)`` into three
    factors ``<= 1`` and the sum is a matmul; inside a sub-block it is formed pairwise, (r, l, d)
    at a time. No factor exceeds 1, so arbitrarily strong decays cannot overflow.
    """
    n = block_start.shape[-2]
    rows, cols = a.shape[-2] // n, b.shape[-2] // n  # rows and columns per sub-block
    blocked = lambda x, size: x.reshape(x.shape[:-2] + (n, size, x.shape[-1]))
    earlier = np.tril(np.ones((n, n), bool), -1)  # block J < block I
    left = blocked(a * jnp.exp(log_a - jnp.repeat(block_start, rows, axis=-2)), rows)
    right = blocked(b * jnp.exp(jnp.repeat(block_end, cols, axis=-2) - log_b), cols)
    between = _masked_exp(
        block_start[..., :, None, :] - block_end[..., None, :, :], earlier[:, :, None]
    )  # (..., I, J, d)
    right = (between[..., :, :, None, :] * right[..., None, :, :, :]).reshape(
        block_start.shape[:-2] + (n, b.shape[-2], b.shape[-1])
    )  # (..., I, L, d): zero for the columns of blocks J >= I
    across = (left @ jnp.swapaxes(right, -1, -2)).reshape(a.shape[:-1] + (b.shape[-2],))
    pairwise = _masked_exp(
        blocked(log_a, rows)[..., :, None, :] - blocked(log_b, cols)[..., None, :, :],
        mask[:rows, :cols, None],
    )  # (..., n, rows, cols, d), the same causal pattern in every sub-block
    # A fused multiply-sum: as an einsum its gradient needs large transposes.
    products = blocked(a, rows)[..., :, None, :] * blocked(b, cols)[..., None, :, :]
    within = jnp.sum(products * pairwise, axis=-1)
    place = np.eye(n, dtype=within.dtype)[:, None, :, None]  # block-diagonal placement
    within = within[..., :, :, None, :] * _broadcast_mask(place, within.ndim + 1)
    return across + within.reshape(across.shape)


def _sub_block(size):
    """Tokens per sub-block of key-wise decays: the largest divisor of the chunk <= SUB_BLOCK."""
    return max(d for d in range(1, min(size, SUB_BLOCK) + 1) if size % d == 0)


def _apply_rows(matrix, x):
    """``matrix (..., R, M, L)`` times ``x (..., L, d_v)``: one matrix for all value rows when
    ``R == 1``, else matrix ``i`` acts on value row ``i``."""
    if matrix.shape[-3] == 1:
        return matrix[..., 0, :, :] @ x
    # One small matrix per value row: a fused multiply-sum beats per-row dots on XLA:CPU.
    return jnp.swapaxes(jnp.sum(matrix * jnp.swapaxes(x, -1, -2)[..., :, None, :], axis=-1), -1, -2)


def _chunk_step(carry, xs, *, window, key_decay, after, exact, initial):
    """One chunk of the general rule: masked matmuls and one triangular inverse per chunk.

    ``carry``: the chunk-start state (B, H, d_v, d_k). With documents (``xs``'s last entry
    ``(begins, starts)``, (B, 1, C) each, else None) each segment (``documents.Segments``)
    reads its own base state, decayed from the segment's start, and the in-chunk sums run
    inside segments; the mini-batch rule (``exact=False``) then carries the pair (the state the
    unfinished mini-batch's gradients are taken at, the state)."""
    q, k, v, write, beta, log_decay, k_halo, v_halo, docs = xs  # (B, H, C, d), gates (B, H, C, R)
    seg = None if docs is None else documents.segments(*docs)
    grad_base, state = carry if seg is not None and not exact else (carry, carry)
    size, slots = q.shape[-2], window
    if window > 1:  # row r of a chunk is slot r % c of token r // c
        k, v = _window_rows(k_halo, k, window), _window_rows(v_halo, v, window)
    length = k.shape[-2]
    token = np.arange(length) // slots  # static masks: constants of the program
    causal = np.arange(size)[:, None] >= token[None, :]  # (C, L): query t sees rows of tokens <= t
    strict = token[:, None] > token[None, :]  # (L, L): a row is erased by rows of earlier tokens

    def rows(x, axis=-2):  # per token -> per row (slot)
        return x if slots == 1 else jnp.repeat(x, slots, axis=axis)

    erase = beta is not None
    if write is not None:
        v = rows(write) * v
    k_t = jnp.swapaxes(k, -1, -2)

    # Decay factors between positions, (..., R, C, L) for queries and (..., R, L, L) for erases;
    # R = 1 (shared by all value rows) or d_v (Falcon-2). Key-wise decays fold them into the
    # inner products instead. The reads of the base state decay from the segment's start.
    q_read, k_erase, strength = q, k, beta
    if log_decay is None:
        scores = _broadcast_mask(causal, q.ndim) * (q @ k_t)
        coupling = _broadcast_mask(strict, k.ndim) * (k @ k_t) if erase else None
        scores, coupling = _add_row_axis(scores), _add_row_axis(coupling)
    else:
        g = jnp.cumsum(log_decay, axis=-2)  # (..., C, R or d_k), log Gamma_t
        g_erase = g if after else g - log_decay
        g_base, ge_base = g, g_erase
        if seg is not None:
            offset = jnp.take_along_axis(g - log_decay, seg.start[..., None], axis=-2)
            g_base, ge_base = g - offset, g_erase - offset
        if key_decay:
            q_read, k_erase = jnp.exp(g_base) * q, jnp.exp(rows(ge_base)) * k
            sub = _sub_block(size)
            ends = (g - log_decay)[..., ::sub, :], g[..., sub - 1 :: sub, :]  # sub-block ends
            scores = _add_row_axis(_key_decayed_gram(q, k, g, rows(g), *ends, causal))
            if erase:
                coupling = _key_decayed_gram(k, k, rows(g_erase), rows(g), *ends, strict)
                coupling = _add_row_axis(coupling)
        else:
            g_cols = rows(jnp.swapaxes(g, -1, -2)[..., None, :], axis=-1)  # (..., R, 1, L)
            g_t = jnp.swapaxes(g, -1, -2)[..., :, None]  # (..., R, C, 1)
            scores = _masked_exp(g_t - g_cols, causal) * _add_row_axis(q @ k_t)
            if erase:
                ge_t = rows(jnp.swapaxes(g_erase, -1, -2), axis=-1)[..., :, None]
                coupling = _masked_exp(ge_t - g_cols, strict) * _add_row_axis(k @ k_t)
                strength = beta * jnp.exp(ge_base)
    if seg is not None:
        same = seg.same[:, :, None]  # (B, 1, 1, C, C), as the (..., R, C, L) factors
        scores, coupling = same * scores, None if coupling is None else same * coupling

    # Reads of the chunk-start state by the erase terms and by the queries, in one matmul.
    both = jnp.concatenate([k_erase, q_read], axis=-2)
    reads = _reads(both, state, length)
    if grad_base is not state:  # the mini-batch's gradients are taken at its start
        reads = (_reads(k_erase, grad_base, length)[0], reads[1])
    if seg is not None:
        later = _reads(both, initial, length)
        first = seg.first[..., None]
        reads = tuple(jnp.where(first, a, b) for a, b in zip(reads, later, strict=True))
    k_state, q_state = reads
    u = v
    if erase:
        u = v - rows(strength) * k_state
        if exact:
            coupling = jnp.swapaxes(rows(beta), -1, -2)[..., :, :, None] * coupling
            u = _apply_rows(unit_lower_inverse(coupling), u)
    if seg is not None and not exact:  # the running document's next mini-batch, if it begins
        mid = state + jnp.swapaxes(seg.first[..., None] * u, -1, -2) @ k
        k_mid, q_mid = _reads(both, mid, length)
        second = seg.second[..., None]
        if erase:
            u = jnp.where(second, v - rows(strength) * k_mid, u)
        q_state = jnp.where(second, q_mid, q_state)
    if log_decay is not None and not key_decay:
        q_state = jnp.exp(g_base) * q_state
    o = q_state + _apply_rows(scores, u)

    if seg is not None:  # the end state continues the last segment's base by its writes
        base = documents.pick(seg.first, state, initial)
        if not exact:
            grad_base = documents.pick(
                seg.first, grad_base, documents.pick(seg.second, mid, initial)
            )
            base = documents.pick(seg.second, mid, base)
        state, u = base, seg.last[..., None] * u
    if log_decay is None:
        new = state + jnp.swapaxes(u, -1, -2) @ k
    else:
        decay_to_end = jnp.exp(rows(g[..., -1:, :] - g))  # (..., L, R or d_k)
        if key_decay:
            new = state * jnp.exp(g_base[..., -1:, :])
            new = new + jnp.swapaxes(u, -1, -2) @ (decay_to_end * k)
        else:
            end = jnp.swapaxes(jnp.exp(g_base[..., -1:, :]), -1, -2)  # (..., R, 1)
            new = state * end + jnp.swapaxes(decay_to_end * u, -1, -2) @ k
    return (new if seg is None or exact else (grad_base, new)), o


def _reads(rows, state, length):
    """``rows (..., L', d_k)`` times ``state^T``, split after ``length`` rows (erase, query)."""
    reads = rows @ jnp.swapaxes(state, -1, -2)
    return reads[..., :length, :], reads[..., length:, :]


def _add_row_axis(matrix):
    return None if matrix is None else matrix[..., None, :, :]
