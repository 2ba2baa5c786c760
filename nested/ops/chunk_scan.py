"""The Type II ops' momentum rule over a sequence: a scan over chunks, mini-batch or online.

The rule and the coefficients of a chunk are ``nested.ops.chunk_coefficients``'s. Two steps
run it over a chunk of tokens, both reading and writing the state in dual form
(``mlp_memory.dual_read``) from one set of coefficients:

- ``minibatch_step`` (``every = C``): within a chunk starting at (theta_s, S_s) every gradient
  is taken at theta_s (``mlp_memory.sample_grads``).
- ``online_step`` (chunk size 1: token t's gradient at theta_{t-1}) keeps those coefficients:
  the gradients are still rank-one per sample, only taken at different states. It runs in
  blocks of ONLINE_BLOCK tokens; inside a block a scan over tokens computes each token's
  gradient factors at theta_{t-1} = A_{t-1} theta_s + c_{t-1} S_s - sum_{i<t} Gamma_{t-1,i}
  grad l_i in dual form (``nested.ops.online``: matrix-vector products with the block-start
  state, never a per-token state; its backward is written out), then the block's reads and
  its end state are formed as for a chunk.

Reads: ``"after_write"`` reads theta_t (dual form), ``"chunk_start"`` reads theta_s, or for the
online rule theta_{t-1}. Sequences of any length are padded with inert tokens (m = alpha = 1,
u = w = 0, gate 0, zero inputs: ``INERT``) that leave (theta, S) unchanged, then sliced; the
chunk loop is a ``lax.scan`` whose body is rematerialised (``jax.checkpoint``) so the backward
stores only chunk-boundary states.

Packed documents (``starts``, :mod:`nested.ops.documents`): the coefficients of a chunk are cut
into segments (no coupling across, products restarted at each segment's start), so a chunk's
gradient factors and reads computed from one base state are right on the tokens whose segment
starts from that base; ``by_segments`` computes them from each base (the carried state, a
mini-batch's state after the first segment, the documents' initial state), keeps each token's
reads, and continues the last segment's base, with the gradients taken from it, to the chunk's
end state. An Omega window reads, for a document's first window - 1 tokens, the samples of the
window that document started with in place of the previous document's (``window_samples``).
Documents declared on a grid the chunks divide (``documents.on_grid``) restart the carry at a
chunk's first token and run every chunk without segments.
"""

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested.ops import chunk_coefficients as cc
from nested.ops import documents, loops, online
from nested.ops import mlp_memory as mm

Array = jax.Array

# Up to this many chunks the backward stores every chunk's state; beyond, segments of chunks.
FLAT_CHUNKS = 64
# Tokens per scan step of the online rule (chunk size 1): the state is formed once a block.
ONLINE_BLOCK = 16
READS = ("after_write", "chunk_start")


class ChunkInputs(NamedTuple):
    """The rule's per-token inputs, (B, T, H, ...) for a sequence and (B, H, C, ...) in a chunk
    (``scan_chunks``); the gates are (B, T, H) or (B, H, C), None where the op has no such term.
    Packed documents (``nested.ops.documents``): ``starts`` (B, T) bool given to ``scan_rule``,
    which adds ``begins``; both (B, T, 1) in the scan's sequence and (B, 1, C) in a chunk."""

    q: Array  # queries (..., d_in)
    k: Array  # sample keys (..., d_in)
    v: Array  # sample targets (..., d_out)
    step_in: Array  # u: the gradient's step into the momentum
    step_out: Array | None = None  # w: the momentum's step into theta (None: 1)
    mom: Array | None = None  # m: momentum retention (None: no momentum)
    keep: Array | None = None  # alpha = 1 - a: theta's retention (None: 1)
    gate: Array | None = None  # g: Omega sample gates (None: one sample a token, weight 1)
    starts: Array | None = None  # where a document starts (None: one document)
    begins: Array | None = None  # where a segment begins: a document, or a period of one


# Padding that makes a token a no-op of the rule: no step, retentions 1, no samples.
INERT = ChunkInputs(
    q=0.0,
    k=0.0,
    v=0.0,
    step_in=0.0,
    step_out=0.0,
    mom=1.0,
    keep=1.0,
    gate=0.0,
    starts=False,
    begins=False,
)


class Samples(NamedTuple):
    """Omega-window samples: keys (B, H, N, d_in), values (B, H, N, d_out), gates (B, H, N)."""

    k: Array
    v: Array
    gate: Array


class ScanCarry(NamedTuple):
    """The state between chunks: theta_s and S_s (params-shaped, leading (B, H); momentum None
    without momentum) and the window - 1 samples before the chunk (None without a window).
    With documents: ``restart``, the (params, momentum) every document after the first starts
    from, ``window0`` the window of samples it starts with (with a window), and for
    mini-batches ``at``, the state the unfinished mini-batch's gradients are taken at (its
    start); None otherwise."""

    params: mm.Params
    momentum: mm.Params | None
    prefix: Samples | None
    at: mm.Params | None = None
    restart: tuple[mm.Params, mm.Params | None] | None = None
    window0: Samples | None = None


def cast(tree, dtype):
    """Cast every array leaf to the compute dtype (the scan carry must keep one dtype)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def window_samples(prefix: Samples | None, chunk: ChunkInputs, window: int, window0=None):
    """The samples (k, v) the chunk's losses use, their Omega band (None: one sample per
    token), the rows of each token's window in them ((C, window), or (B, 1, C, window) with
    documents) and the window carried to the next chunk: the window - 1 samples before its
    first token, in that token's document.

    ``prefix`` is that window for this chunk's first token. With documents starting inside
    the chunk (``chunk.starts``) the samples are ``[window0; prefix; chunk]``: a document's
    first tokens read the window it started with (``documents.window_rows``)."""
    if chunk.gate is None:
        return chunk.k, chunk.v, None, None, prefix
    c = chunk.gate.shape[-1]
    rows = online.sample_rows(c, window)
    if window == 1:
        return chunk.k, chunk.v, cc.window_band(chunk.gate, rows), rows, prefix
    samples = Samples(chunk.k, chunk.v, chunk.gate)
    k, v, g = (jnp.concatenate([p, x], axis=2) for p, x in zip(prefix, samples, strict=True))
    if chunk.starts is None:
        tail = Samples(k[:, :, 1 - window :], v[:, :, 1 - window :], g[:, :, 1 - window :])
        return k, v, cc.window_band(g, rows), rows, tail
    k, v, g = (jnp.concatenate([w, x], axis=2) for w, x in zip(window0, (k, v, g), strict=True))
    # Each token's offset in its document if that began in this chunk (the next chunk's
    # first token too), else FIRST_DOCUMENT: its window is in [prefix; chunk].
    offset = documents.offsets(jnp.pad(chunk.starts[:, 0], [(0, 0), (0, 1)]))  # (B, C + 1)
    rows = documents.window_rows(offset[:, None], window)  # (B, 1, C + 1, window)
    take = lambda x, r: jnp.take_along_axis(x, r.reshape(*r.shape[:2], -1, *(1,) * (x.ndim - 3)), 2)
    tail = Samples(*(take(x, rows[:, :, -1, :-1]) for x in (k, v, g)))
    return k, v, cc.window_band(g, rows[:, :, :-1]), rows[:, :, :-1], tail


@jax.named_scope("state_update")
def next_carry(
    carry: ScanCarry,
    coef: cc.ChunkCoefficients,
    theta: mm.ThetaCoefficients,
    grads: mm.GradFactors,
    prefix: Samples | None,
    row: Array | None = None,
) -> ScanCarry:
    """(theta, S) after the chunk's last token (inert padding rows change nothing):

        theta = A theta_s + c S_s - sum_i Gamma_i grad l_i,   S = P S_s - sum_i Lambda_i grad l_i,

    the coefficients' last rows, or with ``row`` (B,) those of token ``row``, the state after
    it (the carry's other fields kept). The minus sign goes into the (N,) weights, not onto
    parameter-sized arrays."""
    params, momentum = carry.params, carry.momentum
    if row is None:
        last = lambda x: None if x is None else x[..., -1]
        rows = lambda x: x[..., -1, :]
    else:
        index = row.reshape(-1, 1, 1)
        last = lambda x: None if x is None else jnp.take_along_axis(x, index, axis=-1)[..., 0]
        rows = lambda x: jnp.take_along_axis(x, index[..., None], axis=-2)[..., 0, :]
    base, carry_c, mom_base = last(theta.base), last(theta.carry), last(coef.mom_base)
    gamma, lam = rows(theta.gamma), rows(coef.lam)
    steps = mm.weighted_grads(-gamma, grads, params)
    if momentum is None:
        new_params = jax.tree.map(lambda p, g: mm.scale(base, p) + g, params, steps)
        return carry._replace(params=new_params, prefix=prefix)
    new_params = jax.tree.map(
        lambda p, s, g: mm.scale(base, p) + mm.scale(carry_c, s) + g, params, momentum, steps
    )
    steps = mm.weighted_grads(-lam, grads, params)
    new_momentum = jax.tree.map(lambda s, g: mm.scale(mom_base, s) + g, momentum, steps)
    return carry._replace(params=new_params, momentum=new_momentum, prefix=prefix)


def minibatch_step(
    carry: ScanCarry, chunk: ChunkInputs, *, form: mm.MemoryForm, read, window, clip=None
):
    """One chunk of the rule with every gradient at the chunk-start state (TTT-MLP, Titans,
    ATLAS without Muon), each sample's gradient clipped to norm ``clip`` (None: not clipped).
    chunk: (B, H, C, ...). Returns (carry, o (B, H, C, d_out))."""
    k, v, band, _, prefix = window_samples(carry.prefix, chunk, window, carry.window0)
    seg = None if chunk.starts is None else documents.segments(chunk.begins, chunk.starts)
    with jax.named_scope("coefficients"):  # momentum and decay recurrences
        coef = cc.coefficients(chunk.step_in, chunk.mom, chunk.keep, band, seg)
        theta = cc.theta_coefficients(coef, chunk.step_out)

    def run(at, params, momentum):  # gradients at ``at``, reads of the state (params, momentum)
        with jax.named_scope("gradients"):
            grads = mm.sample_grads(at, k, v, form)
            if clip is not None:
                grads = mm.clipped(grads, at, clip)
        with jax.named_scope("reads"):
            if read == "after_write":
                return grads, mm.dual_read(params, momentum, theta, chunk.q, grads, form)
            return grads, mm.mlp_apply(at, chunk.q, form)

    if seg is None:
        grads, o = run(carry.params, carry.params, carry.momentum)
        return next_carry(carry, coef, theta, grads, prefix), o
    return by_segments(run, carry, seg, coef, theta, prefix)


def by_segments(run, carry: ScanCarry, seg, coef, theta, prefix: Samples | None = None):
    """A chunk of documents: ``run(at, params, momentum) -> (grads, o)``, the chunk's gradient
    factors and reads from one base state, is run from each segment's base (the coefficients
    couple no two segments, so each run is right on its segment's tokens), and the end state
    continues the last segment's base. Mini-batches (``carry.at`` set): the running document's
    second segment starts from its state after the first. ``prefix``: the window's samples
    carried on. Returns (carry, o)."""
    state, start = (carry.params, carry.momentum), carry.restart
    at = carry.params if carry.at is None else carry.at
    first = run(at, *state)  # every row's chunk begins with it (``at_chunk_start``)
    second = later = needed(~seg.first & ~seg.second, lambda: run(start[0], *start))
    mid = start
    if carry.at is not None:

        def next_period():  # from the state after the first segment
            count = jnp.sum(seg.first, axis=(1, 2))  # (B,): the first segment's tokens
            after = next_carry(carry, coef, theta, first[0], None, row=count - 1)
            return (after.params, after.momentum), run(after.params, after.params, after.momentum)

        mid, second = needed(seg.second, next_period)
    o = documents.select(seg.first, first[1], documents.select(seg.second, second[1], later[1]))
    # The end state is the last segment's: its base, and the gradients taken from it (of every
    # sample its tokens' windows read).
    last = lambda a, b, c: documents.pick(seg.first, a, documents.pick(seg.second, b, c))
    params, momentum = last(state, mid, start)
    grads = last(first[0], second[0], later[0])
    new = next_carry(carry._replace(params=params, momentum=momentum), coef, theta, grads, prefix)
    if carry.at is not None:
        new = new._replace(at=documents.pick(seg.first, at, params))
    return new, o


def needed(segment: Array, run: Callable):
    """``run()`` if a token of some row is in ``segment`` (B, 1, C), else zeros shaped like its
    result: a chunk pays for the bases its segments have (one, where documents start on the
    chunks' grid)."""
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(run))
    return jax.lax.cond(jnp.any(segment), run, zeros)


def scan_documents(step: Callable, carry: ScanCarry, seq: ChunkInputs, *, chunk_size: int):
    """``scan_chunks`` of ``step`` over a sequence of documents (``with_documents``): what
    happens at a chunk's first token goes into the carry (``at_chunk_start``). Where the
    documents are declared on a grid the chunks divide (``documents.on_chunks``), every start
    and update period begins at a chunk's first token: ``step`` runs without segments, one base
    state a chunk, as without documents."""
    if seq.starts is None:
        return scan_chunks(step, carry, seq, chunk_size=chunk_size)
    on_grid = documents.on_chunks(chunk_size)

    def run(carry, chunk):
        carry, chunk = at_chunk_start(carry, chunk)
        return step(carry, chunk._replace(starts=None, begins=None) if on_grid else chunk)

    return scan_chunks(run, carry, seq, chunk_size=chunk_size)


def at_chunk_start(carry: ScanCarry, chunk: ChunkInputs) -> tuple[ScanCarry, ChunkInputs]:
    """With documents, what happens at the chunk's first token happens to the carry: a row
    whose document starts there continues from the restart state (and its window); a row
    whose update period begins there takes its gradients at the state it has. Both boundaries
    leave the chunk's segments, so its first segment runs from the carry in every row."""
    if chunk.starts is None:
        return carry, chunk
    restart = chunk.starts[:, 0, 0]  # (B,)
    pick = lambda new, old: None if old is None else documents.choose(restart, new, old)
    params, momentum = pick(carry.restart[0], carry.params), pick(carry.restart[1], carry.momentum)
    carry = carry._replace(params=params, momentum=momentum)
    if carry.window0 is not None:
        carry = carry._replace(prefix=pick(carry.window0, carry.prefix))
    if carry.at is not None:
        carry = carry._replace(at=documents.choose(chunk.begins[:, 0, 0], params, carry.at))
    cleared = lambda x: x.at[:, :, 0].set(False)
    return carry, chunk._replace(starts=cleared(chunk.starts), begins=cleared(chunk.begins))


def online_step(carry: ScanCarry, block: ChunkInputs, *, form: mm.MemoryForm, read, window):
    """One block of the online rule: token t's gradient at theta_{t-1} (``online.block_grads``).
    block: (B, H, C, ...) for C = ONLINE_BLOCK tokens. Returns (carry, o (B, H, C, d_out))."""
    k, v, band, rows, prefix = window_samples(carry.prefix, block, window, carry.window0)
    seg = None if block.starts is None else documents.segments(block.begins, block.starts)
    coef = cc.coefficients(block.step_in, block.mom, block.keep, None, seg)
    theta = cc.theta_coefficients(coef, block.step_out)
    before = cc.before_each_token(theta, seg)
    # Per-token coefficients spread over each token's samples (columns (token, sample)),
    # times the samples' gates.
    c = theta.base.shape[-1]
    if band is None:
        rows = online.sample_rows(c, 1)
        gates = jnp.ones((*theta.base.shape, 1), theta.base.dtype)
    else:
        gates = jnp.take_along_axis(band, online.rows_like(rows, band), axis=-1)
    per_sample = lambda m: (m[..., None] * gates[:, :, None]).reshape(*m.shape[:-1], -1)
    before = before._replace(gamma=per_sample(before.gamma))
    theta = theta._replace(gamma=per_sample(theta.gamma))
    coef = coef._replace(lam=per_sample(coef.lam))
    read_at = theta if read == "after_write" else before

    def run(at, params, momentum):  # the online rule's gradients are at each token's state
        grads = online.block_grads(params, momentum, before, k, v, form, rows)
        return grads, mm.dual_read(params, momentum, read_at, block.q, grads, form)

    if seg is None:
        grads, o = run(carry.params, carry.params, carry.momentum)
        return next_carry(carry, coef, theta, grads, prefix), o
    return by_segments(run, carry, seg, coef, theta, prefix)


def scan_rule(
    carry: ScanCarry, seq: ChunkInputs, *, chunk_size: int, form, read, window, clip=None
):
    """The rule over a sequence (``scan_chunks``): ``minibatch_step`` over chunks of
    ``chunk_size`` (gradients clipped to norm ``clip`` unless None), or for ``chunk_size=1``
    ``online_step`` over blocks of ONLINE_BLOCK (no clip: its backward is written out).

    Documents (``seq.starts`` (B, T)): each runs as if alone, every one after the first from
    ``carry.restart`` (and with a window ``carry.window0``), its mini-batches counted from its
    start (``with_documents``)."""
    online_rule = chunk_size == 1
    if online_rule and clip is not None:
        raise ValueError(f"clip={clip!r} needs chunk_size > 1: the online rule does not clip")
    kwargs = {} if online_rule else {"clip": clip}
    step = partial(
        online_step if online_rule else minibatch_step,
        form=form,
        read=read,
        window=window,
        **kwargs,
    )
    carry, seq = with_documents(carry, seq, chunk_size=chunk_size, window=window)
    chunk = ONLINE_BLOCK if online_rule else chunk_size
    o, carry = scan_documents(step, carry, seq, chunk_size=chunk)
    return o, carry._replace(at=None, restart=None, window0=None)


def with_documents(carry: ScanCarry, seq: ChunkInputs, *, chunk_size: int, window: int):
    """The carry and sequence a scan over documents needs (``seq.starts`` (B, T); unchanged
    without): where segments begin (every start, and with mini-batches of ``chunk_size`` the
    running document's periods) and the mini-batch's gradient state ``at``."""
    if seq.starts is None:
        return carry, seq
    if window > 1 and carry.window0 is None:
        raise ValueError("document starts with a window need the window they start with")
    starts = seq.starts
    online_rule = chunk_size == 1
    begins = starts if online_rule else documents.period_begins(starts, chunk_size)
    seq = seq._replace(starts=starts[..., None], begins=begins[..., None])
    return (carry if online_rule else carry._replace(at=carry.params)), seq


def segment_size(n_chunks: int) -> int:
    """Chunks per rematerialised segment: 1 (flat) up to FLAT_CHUNKS chunks, else the size in
    [sqrt(n) / 2, sqrt(n)] that pads the fewest chunks (the largest among equals): 8 for 128."""
    if n_chunks <= FLAT_CHUNKS:
        return 1
    root = math.isqrt(n_chunks - 1) + 1
    return min(range(root, max(2, root // 2) - 1, -1), key=lambda g: -n_chunks % g)


def scan_chunks(step: Callable, carry, seq: ChunkInputs, *, chunk_size: int):
    """Run ``step(carry, chunk) -> (carry, o)`` over chunks of a sequence.

    seq: (B, T, H, ...) inputs, padded at the end with ``INERT`` tokens to whole chunks and
    handed to ``step`` as (B, H, C, ...) chunks. Returns (o (B, T, H, d), carry).

    Each chunk is rematerialised, so the backward keeps one (theta, S) per chunk, plus for the
    online form the per-token vectors its scan saves (``online.SAVED``: linear in T). Beyond
    FLAT_CHUNKS chunks (e.g. online sequences beyond 1024 tokens) that state count is cut to
    about 2 sqrt(n) by rematerialising segments of sqrt(n) chunks too, for one more forward of
    everything but the online scans (their saved vectors are kept across segments too).
    """
    batch, length = seq.q.shape[:2]
    n_chunks = -(-length // chunk_size)
    group = segment_size(n_chunks)
    n_chunks = -(-n_chunks // group) * group
    pad = n_chunks * chunk_size - length

    def to_chunks(x, inert):
        if x is None:
            return None
        if pad:
            widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, widths, constant_values=inert)
        x = x.reshape(batch, n_chunks, chunk_size, *x.shape[2:])
        x = jnp.moveaxis(x, (1, 3), (0, 2))  # (n, B, H, C, ...)
        return x if group == 1 else x.reshape(n_chunks // group, group, *x.shape[1:])

    xs = ChunkInputs(*map(to_chunks, seq, INERT))
    keep = jax.checkpoint_policies.save_only_these_names(online.SAVED)
    body = step
    if group > 1:
        body = lambda c, x: loops.remat_scan(step, c, x, policy=keep)
    carry, o = loops.remat_scan(body, carry, xs, policy=keep)
    o = o.reshape(n_chunks, *o.shape[-4:])
    o = jnp.moveaxis(o, (0, 2), (1, 3))  # (B, n, C, H, d)
    o = o.reshape(batch, n_chunks * chunk_size, *o.shape[3:])
    return o[:, :length], carry
