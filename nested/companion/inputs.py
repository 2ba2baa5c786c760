"""What a companion request may hold, and the error it gets otherwise.

An agent id is :data:`AGENT_ID`; an observation is at most :data:`MAX_TOKENS` token ids in
``[0, vocab)`` (or a text that encodes to them, :mod:`~nested.companion.text`), a multiple of
the model's update period long; a recall at most :data:`MAX_QUERIES` queries of at most
:data:`MAX_QUERY_TOKENS` tokens. Only finite states are served (:func:`finite`). Anything else
is a :class:`CompanionError` naming the field and the fix, with the HTTP status it answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

AGENT_ID = "letters, digits, '_' and '-', 1 to 128 characters"
MAX_TOKENS = 8192  # tokens per observe request
MAX_QUERIES = 256  # queries per recall request
MAX_QUERY_TOKENS = 512
MAX_STORED_TOKENS = 2**63 - 1  # tokens observed: SQLite's INTEGER is a signed 64-bit int


class CompanionError(ValueError):
    """A request the companion refuses; the message names the field and the fix. ``status``:
    the HTTP status the server answers with (400 a bad agent id, 409 an agent whose stored
    state is damaged or of another model, 422 other bad input)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def check_agent_id(agent_id: Any) -> str:
    """``agent_id`` if it is a valid id (:data:`AGENT_ID`), else :class:`CompanionError`."""
    ok = (
        isinstance(agent_id, str)
        and 1 <= len(agent_id) <= 128
        and all(c.isascii() and (c.isalnum() or c in "_-") for c in agent_id)
    )
    if not ok:
        shown = agent_id if not isinstance(agent_id, str) or len(agent_id) <= 40 else agent_id[:40]
        raise CompanionError(f"agent id {shown!r} is not valid; use {AGENT_ID}", status=400)
    return agent_id


def check_tokens(
    tokens: Any,
    field: str,
    *,
    vocab: int,
    limit: int,
    multiple: int = 1,
    encode: Callable[[str, str], np.ndarray],
) -> np.ndarray:
    """``tokens`` as int32 ``(n,)``: a non-empty list of ints in ``[0, vocab)``, or a string
    that ``encode(text, field)`` turns into one, at most ``limit``, a multiple of ``multiple``
    long; else :class:`CompanionError` naming ``field``."""
    what = "tokens"
    if isinstance(tokens, str):
        tokens, what = encode(tokens, field), "tokens (the text's encoding)"
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as error:
        raise CompanionError(f"{field}: must be a list of token ids ({error})") from error
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise CompanionError(f"{field}: must be a non-empty list of integer token ids")
    if array.size > limit:
        raise CompanionError(f"{field}: {array.size} {what}, more than the limit {limit}")
    if array.size % multiple:
        raise CompanionError(
            f"{field}: {array.size} {what}; this model updates every {multiple} tokens, so "
            f"an observation is a multiple of {multiple} tokens"
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab:
        raise CompanionError(
            f"{field}: token ids in [{low}, {high}], outside [0, {vocab}) (the model's vocabulary)"
        )
    return array.astype(np.int32)


def finite(tree) -> bool:
    """Whether every floating-point value of ``tree``'s arrays is finite."""
    return all(
        np.all(np.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(np.asarray(x).dtype, jnp.inexact)
    )
