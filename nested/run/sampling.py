"""Sampling: ``generate(program, params, prompt, ...)`` continues token ids, every fast state
carried token by token.

As flax's and gemma's samplers: a prefill of the prompt, then one jitted step per new token
over a buffer of fixed size, so nothing compiles per number of tokens (the prefill compiles
per prompt length). The result is exact: the returned fast state is the one a single
``program.apply`` over the prompt and its continuation ends with, and every token is drawn
from the logits that call gives at its position (``tests/run/test_sampling.py``).

**Cutting a stream.** A level updating at every token continues a stream cut anywhere; one
with a period ``every = C`` (mini-batch TTT, chunked Titans) and a memory-as-context segment of
``window`` tokens continue it exactly only from a cut at a multiple of their period. So the
sampler keeps the fast state at the last multiple of the *stream period* ``P``
(:func:`stream_period`, their least common multiple; 1 for online levels) and a buffer
``(B, P)`` of the ``n <= P`` tokens since. Each step runs the model over the buffer from that
state (the model is causal: the logits at position ``n - 1`` do not see the unused entries),
draws the next token from them, and once the buffer is full moves the state on by it. A step
costs ``P`` tokens of compute.

**Whole-stream attention.** A layer attending to every earlier token of its call (attention
with ``window=None`` outside Titans MAC segments: :func:`whole_stream_layers`) keeps none of
them in its state, so no cut would continue its stream. The sampler runs such a model with
those layers' window set to ``W = L + max_new_tokens`` (:func:`reaching`): a sliding window
wider than the sequence attends to every earlier token, exactly as ``window=None`` over the
whole sequence, and its cache keeps the last ``W - 1`` keys and values, so each step reads the
cache and its new token. Such a model starts from a fresh state (``fast=None``), and the
returned ``fast`` is that of ``reaching(program, W)``.

**Drawing.** ``temperature=0``: greedy (argmax). Else a draw from
``softmax(logits / temperature)``, restricted to the ``top_k`` most likely tokens when given;
draw ``i`` uses ``fold_in(rng, i)``, so a seed fixes the continuation. A row stops after any
of the ``stop`` tokens (the stop token is part of its continuation); generation ends when
every row has stopped or after ``max_new_tokens``. Draws are over the ``program.vocab`` real
ids: a padded vocabulary's columns (``model.vocab_multiple``) are cut off, so a padded model
draws what the same weights unpadded draw.

Levels learning from the outer loss (CMS blocks) read their state without learning, as in
``Program.apply`` without targets.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested.core.scheduler import Program
from nested.nn.attention import SlidingWindowAttention
from nested.nn.hybrid import AdaTransformerMixer, MemoryAsContext


class SamplingError(ValueError):
    """An argument of :func:`generate` that cannot be used; the message names it and the fix."""


class Sample(NamedTuple):
    """What :func:`generate` returns.

    ``tokens (B, N)`` int32: the continuation, ``N <= max_new_tokens`` (a row's entries after
    its stop token are 0); ``lengths (B,)``: each row's tokens up to and including its stop
    token (``N`` if it has none); ``fast``: the fast state after the prompt and all of
    ``tokens``, as ``program.apply(params, concat(prompt, tokens))`` returns it.
    """

    tokens: jax.Array
    lengths: np.ndarray
    fast: Any


class _Carry(NamedTuple):
    fast: Any  # the state at the last multiple of the stream period
    buffer: jax.Array  # (B, P) int32: the tokens since, then zeros
    n: jax.Array  # () int32: tokens in the buffer, 1..P
    done: jax.Array  # (B,) bool: rows that produced a stop token


def stream_period(program: Program, params, *, learning: bool = False) -> int:
    """P: cut at multiples of P, a stream continues exactly (the least common multiple of the
    periods of the levels learning from a local loss and of the memory-as-context segments;
    with ``learning``, when the stream comes with targets, also the span the outer-loss levels
    run in)."""
    levels = program.system.fast_levels
    periods = [level.every for level in levels if not level.learns_outer_loss]
    modules = nnx.iter_modules(program.model(params))
    periods += [module.window for _, module in modules if isinstance(module, MemoryAsContext)]
    spans = [level.every for level in levels if level.learns_outer_loss]
    if learning and spans:
        periods.append(min(spans))
    return math.lcm(*periods)


def whole_stream_layers(model: nnx.Module) -> list[nnx.Module]:
    """The layers of ``model`` that attend to every earlier token of their call (``window=None``;
    within Titans MAC segments attention spans a segment, which :func:`stream_period` cuts)."""
    modules = list(nnx.iter_modules(model))
    segments = [path for path, module in modules if isinstance(module, MemoryAsContext)]
    return [
        module
        for path, module in modules
        if isinstance(module, SlidingWindowAttention | AdaTransformerMixer)
        and module.window is None
        and not any(path[: len(s)] == s for s in segments)
    ]


@functools.lru_cache(maxsize=16)
def reaching(program: Program, window: int) -> Program:
    """``program`` with the window of its :func:`whole_stream_layers` set to ``window`` tokens:
    on sequences of at most ``window`` tokens it computes what ``program`` computes (the same
    parameters), and its attention caches keep ``window - 1`` keys."""
    model = nnx.merge(program.graphdef, program._abstract_params)  # shapes only
    for layer in whole_stream_layers(model):
        layer.window = window
    out = copy.copy(program)
    out.graphdef = nnx.split(model)[0]
    return out


@functools.partial(jax.jit, static_argnames="program")
def _run(params, tokens: jax.Array, fast, *, program: Program):
    """The fast state after ``tokens (B, T)`` from ``fast``."""
    return program.apply(params, tokens, fast)[1]


@functools.partial(jax.jit, static_argnames=("program", "greedy", "top_k", "vocab"))
def _step(carry: _Carry, params, stop, key, index, temperature, *, program, greedy, top_k, vocab):
    """One new token per row from the buffer, an id below ``vocab``; see the module docstring."""
    logits, after = program.apply(params, carry.buffer, carry.fast)  # (B, P, V)
    logits = jax.lax.dynamic_index_in_dim(logits, carry.n - 1, axis=1, keepdims=False)
    logits = logits[:, :vocab]  # a padded vocabulary's columns, or a tokenizer's: never drawn
    if greedy:
        token = jnp.argmax(logits, axis=-1)
    else:
        logits = logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        token = jax.random.categorical(jax.random.fold_in(key, index), logits)
    token = jnp.where(carry.done, 0, token).astype(jnp.int32)
    full = carry.n == carry.buffer.shape[1]
    fast = jax.tree.map(lambda new, old: jnp.where(full, new, old), after, carry.fast)
    n = jnp.where(full, 0, carry.n)
    buffer = jnp.where(full, 0, carry.buffer).at[:, n].set(token)
    return _Carry(fast, buffer, n + 1, carry.done | jnp.isin(token, stop)), token


def _count(value, name: str, low: int, high: int | None = None) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise SamplingError(f"{name}={value!r} must be an int >= {low}")
    if high is not None and value > high:
        raise SamplingError(f"{name}={value!r} must be at most {high} (the vocabulary)")


def generate(
    program: Program,
    params,
    prompt,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop: Sequence[int] = (),
    rng: int | jax.Array = 0,
    fast=None,
    vocab: int | None = None,
) -> Sample:
    """Continue ``prompt (B, L)`` (token ids, ``L >= 1``) by up to ``max_new_tokens`` tokens.

    ``params``: the slow parameters (``state.params``); ``fast``: the fast state to continue
    from (a memory session of batch ``B``), None for the one a sequence starts from
    (``program.start_fast``); ``temperature``, ``top_k``, ``stop``, ``rng`` (a seed or a PRNG
    key): see the module docstring. ``vocab``: new ids are drawn below it (a tokenizer with
    fewer ids than the model's vocabulary); None: the model's (``program.vocab``). Raises
    :class:`SamplingError` naming a bad argument.
    """
    prompt = jnp.asarray(prompt)
    try:
        program.check_tokens(prompt, "prompt")
    except ValueError as error:
        raise SamplingError(str(error)) from None
    prompt, (B, L) = prompt.astype(jnp.int32), prompt.shape
    if L == 0:
        raise SamplingError("prompt is empty; pass at least one token id to continue, (B, L >= 1)")
    _count(max_new_tokens, "max_new_tokens", 1)
    if (
        not isinstance(temperature, numbers.Real)
        or isinstance(temperature, bool)
        or temperature < 0
    ):
        raise SamplingError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if vocab is None:
        vocab = program.vocab
    _count(vocab, "vocab", 1, program.vocab)
    if top_k is not None:
        _count(top_k, "top_k", 1, vocab)
    stop = tuple(stop)
    for token in stop:
        _count(token, "stop token", 0, program.vocab - 1)
    if not isinstance(rng, numbers.Integral | jax.Array) or isinstance(rng, bool):
        raise SamplingError(f"rng={rng!r} must be a seed (an int) or a jax.random key")
    whole = bool(whole_stream_layers(program.model(params)))
    if whole and fast is not None:
        raise SamplingError(
            "fast: this model attends to its whole stream (attention window=None) and keeps no "
            "state of it to continue; pass fast=None (and the whole stream as the prompt)"
        )
    if whole:
        program = reaching(program, L + max_new_tokens)
    if fast is None:
        fast = program.start_fast(params, B)
    batch = {leaf.shape[0] for leaf in jax.tree.leaves(fast)}
    if batch != {B}:
        raise SamplingError(
            f"fast has batch size(s) {sorted(batch)}, the prompt {B} row(s); pass the fast "
            f"state of a session of {B} stream(s), or None to start fresh"
        )

    period = stream_period(program, params)
    n = (L - 1) % period + 1  # the prompt's last n tokens start the buffer
    if n < L:
        fast = _run(params, prompt[:, : L - n], fast, program=program)
    buffer = jnp.zeros((B, period), jnp.int32).at[:, :n].set(prompt[:, L - n :])
    carry = _Carry(fast, buffer, jnp.int32(n), jnp.zeros((B,), bool))
    key = rng if isinstance(rng, jax.Array) else jax.random.key(rng)
    stop_ids = jnp.asarray(stop, jnp.int32).reshape(-1)
    options = dict(program=program, greedy=temperature == 0, top_k=top_k, vocab=vocab)
    tokens = []
    for index in range(max_new_tokens):
        carry, token = _step(carry, params, stop_ids, key, index, temperature, **options)
        tokens.append(token)
        if stop and bool(jnp.all(carry.done)):
            break
    tokens = jnp.stack(tokens, axis=1)
    fast = _run(params, carry.buffer[:, : int(carry.n)], carry.fast, program=program)
    stopped = np.isin(np.asarray(tokens), stop)
    lengths = np.where(stopped.any(axis=1), stopped.argmax(axis=1) + 1, tokens.shape[1])
    return Sample(tokens, lengths, fast)
