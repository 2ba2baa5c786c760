"""A stream cut anywhere, for the ops whose mini-batches are semantic (TTT, Titans, ATLAS).

A mini-batch op takes every gradient of a chunk at the chunk's start state, and its chunks
start at the call's first token: two calls cut at a multiple of ``chunk_size`` equal one call,
a cut inside a chunk does not (the piece after it starts a new chunk). :func:`stream` keeps
the tokens of the unfinished last chunk, ``pending``, and replays them in front of the next
piece, so every piece's outputs equal those of one call over the whole stream wherever it is
cut, token by token included (decoding). The state it carries is the state at the last chunk
boundary; one call's final state, which also applies the unfinished chunk, is
``op(*pending, state=state, ...)[1]``.

Exact because token ``t``'s output depends only on the chunk-start state and the chunk's
tokens up to ``t`` (dual-form and chunk-start reads alike); a piece recomputes the outputs of
at most ``chunk_size - 1`` pending tokens, and each pending length is its own compiled shape.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from nested.ops import validation

STATE_ARGS = ("state", "params", "initial_state")


def stream(
    op: Callable,
    *inputs: jax.Array,
    pending: tuple[jax.Array, ...] | None = None,
    chunk_size: int,
    **kwargs,
):
    """One piece of a stream through a mini-batch op, deferring its unfinished last chunk.

    Args:
      op: ``nested.ops.ttt_mlp``, ``titans``, ``atlas``, ``ttt_linear`` (any op whose
        ``chunk_size`` is its mini-batch), called as ``op(*inputs, chunk_size=..., **kwargs)``.
      inputs: the op's positional ``(B, T, H, ...)`` arrays for this piece (q, k, v, gates).
      pending: the previous piece's pending tokens (None at the start of the stream).
      chunk_size: the op's mini-batch size C.
      kwargs: the op's keyword arguments, including its state at the last chunk boundary
        (``state=``, ``params=`` or ``initial_state=``, as the op names it).
    Returns:
      ``(o, state, pending)``: the piece's outputs ``(B, T, H, d_v)``, the state at the last
      chunk boundary and the tokens after it (a tuple like ``inputs``, or None).
    """
    name = validation.check_one_of({n: n in kwargs for n in STATE_ARGS}, "the op's state as ")
    validation.check_pending(pending, inputs)
    if pending is not None:
        pairs = zip(pending, inputs, strict=True)
        inputs = tuple(jnp.concatenate([p, x], axis=1) for p, x in pairs)
    replayed = 0 if pending is None else pending[0].shape[1]
    length = inputs[0].shape[1]
    boundary = length // chunk_size * chunk_size
    piece = lambda lo, hi: tuple(x[:, lo:hi] for x in inputs)
    outputs = []
    if boundary:
        o, kwargs[name] = op(*piece(0, boundary), chunk_size=chunk_size, **kwargs)
        outputs.append(o)
    pending = None
    if boundary < length:
        pending = piece(boundary, length)
        outputs.append(op(*pending, chunk_size=chunk_size, **kwargs)[0])
    o = jnp.concatenate(outputs, axis=1)[:, replayed:]
    return o, kwargs[name], pending
