"""Packed documents inside a chunked op: where each chunk's tokens restart the memory.

A sequence may pack several documents (flash-linear-attention's ``cu_seqlens``), given as
``starts (B, T)``: True where a new document starts (position 0 never is one). Each document
must run as if alone: the first from the op's state, every later one from an initial state, its
update periods (mini-batches) counted from its own start. A chunked op keeps its chunks on the
sequence's grid and splits each chunk into *segments*, runs of tokens that share one base
state: inside a chunk only tokens of one segment interact, every token reads its segment's
base, and the chunk's end state is its last segment's.

Segment 0 continues the chunk-start state. With one update a token every later segment is a
document. With mini-batches of ``every`` tokens on a grid of ``every``-token chunks the
document running at the chunk start may begin its next mini-batch inside the chunk, the
``second`` segment (from the state after the first); every later segment is a document
starting inside the chunk (whose next period begins beyond the chunk's end).

Documents on a declared grid (:func:`on_grid`): where the caller declares that every start of
a call falls at a multiple of ``grid`` positions, and a chunked op's chunks divide ``grid``
(:func:`on_chunks`), every start and every update period begins at a chunk's first token, so
the op restarts its state there and runs each chunk without segments: the cost of one
document. The declaration is static (known when the program is traced); the caller checks it
on the host (``nested.Program.check_batch``). Code that calls an op on a piece of a call's
sequence declares the grid of the piece: ``on_grid(math.gcd(grid(), w))`` for pieces that begin
at multiples of ``w``, ``on_grid(1)`` where a piece begins anywhere.
"""

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp

_GRID: contextvars.ContextVar[int] = contextvars.ContextVar("nested_document_grid", default=1)


@contextlib.contextmanager
def on_grid(grid: int):
    """While tracing inside: every document start of a call's sequence falls at a multiple of
    ``grid`` positions from the call's first token (1: anywhere, the default)."""
    if not isinstance(grid, int) or grid < 1:
        raise ValueError(f"the document grid must be a positive int (1: none), got {grid!r}")
    token = _GRID.set(grid)
    try:
        yield
    finally:
        _GRID.reset(token)


def grid() -> int:
    """The declared grid of document starts (:func:`on_grid`; 1 when none is declared)."""
    return _GRID.get()


def on_chunks(chunk_size: int) -> bool:
    """Whether every document start and update period of ``chunk_size`` tokens falls on the
    first token of a chunk of ``chunk_size`` (the declared grid is a multiple of it)."""
    return grid() % chunk_size == 0


class Segments(NamedTuple):
    """A chunk's segments, (B, 1, C) over its tokens (``same`` (B, 1, C, C))."""

    start: jax.Array  # the index of the first token of each token's segment (0 in segment 0)
    first: jax.Array  # segment 0: the tokens continuing the chunk-start state
    second: jax.Array  # the running document's tokens after segment 0 (mini-batches only)
    same: jax.Array  # token pairs in one segment: only they interact inside the chunk
    last: jax.Array  # the last segment: only its writes reach the chunk's end state


def segments(begins: jax.Array, starts: jax.Array) -> Segments:
    """The segments of a chunk from ``begins`` (B, 1, C), True where a segment begins (a
    document or an update period of the running one), and ``starts``, where a document starts
    (:func:`period_begins` of a chunk, or ``starts`` itself for one update a token)."""
    label = jnp.cumsum(begins, axis=-1)
    index = jnp.broadcast_to(jnp.arange(begins.shape[-1]), begins.shape)
    running = jnp.cumsum(starts, axis=-1) == 0
    return Segments(
        start=jax.lax.cummax(jnp.where(begins, index, 0), axis=begins.ndim - 1),
        first=label == 0,
        second=running & (label > 0),
        same=label[..., :, None] == label[..., None, :],
        last=label == label[..., -1:],
    )


def period_begins(starts: jax.Array, every: int) -> jax.Array:
    """(B, T) bool: where an update period of ``every`` tokens begins, counted from each
    document's start (position 0 and every start begin one)."""
    index = jnp.broadcast_to(jnp.arange(starts.shape[1]), starts.shape)
    begun = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - begun) % every == 0


FIRST_DOCUMENT = 2**30  # the offset of the row's first document: it never reaches a start


def offsets(starts: jax.Array) -> jax.Array:
    """(B, T) int32: each token's position within its document, counted from the document's
    start; :data:`FIRST_DOCUMENT` for the row's first one (it continues the op's state, and
    with it the window of samples the state carries)."""
    index = jnp.broadcast_to(jnp.arange(starts.shape[1], dtype=jnp.int32), starts.shape)
    begun = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    first = jnp.cumsum(starts, axis=1) == 0
    return jnp.where(first, FIRST_DOCUMENT, index - begun)


def window_rows(offset: jax.Array, window: int) -> jax.Array:
    """(..., C, window): the rows of token t's Omega window in the samples ``[initial (window
    - 1); prefix (window - 1); chunk (C)]``, ``offset (..., C)`` the tokens' positions within
    their documents: slot s is sample t - window + 1 + s of the sequence (row ``window - 1 + t
    + s``) if that is in t's document, else entry ``offset_t + s`` of the window its document
    started with (the ``initial`` rows)."""
    lead = (1,) * (offset.ndim - 1)
    t = jnp.arange(offset.shape[-1]).reshape(*lead, -1, 1)
    s = jnp.arange(window).reshape(*lead, 1, -1)
    o = offset[..., None]
    before = window - 1 - s > o  # sample t - window + 1 + s precedes the document's start
    return jnp.where(before, o + s, window - 1 + t + s)


def choose(mask: jax.Array, a, b):
    """``a`` in the batch rows where ``mask`` (B,) holds, else ``b``: pytrees of states with
    leading (B, H)."""
    return jax.tree.map(lambda x, y: jnp.where(mask.reshape(-1, *(1,) * (x.ndim - 1)), x, y), a, b)


def pick(segment: jax.Array, a, b):
    """``a`` where the chunk's last token is in ``segment`` (B, 1, C), else ``b`` (``choose``)."""
    return choose(segment[:, 0, -1], a, b)


def select(segment: jax.Array, a, b):
    """Per token, ``a`` in ``segment`` (B, 1, C), else ``b``: pytrees of (B, H, C, ...) rows."""
    return jax.tree.map(
        lambda x, y: jnp.where(segment.reshape(*segment.shape, *(1,) * (x.ndim - 3)), x, y), a, b
    )
