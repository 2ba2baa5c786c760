"""What a companion request must be, for every way of serving one: the HTTP API
(:mod:`~nested.companion.server`) and the MCP tools (:mod:`~nested.companion.mcp_server`).

* the request models, :class:`Observation` (``tokens`` or ``text``) and :class:`Queries`
  (``queries`` or ``text``): token ids are strict integers (``1.0``, ``"1"`` and ``true`` are
  not), at most :data:`~nested.companion.inputs.MAX_TOKENS` an observe and
  :data:`~nested.companion.inputs.MAX_QUERIES` queries a recall; their JSON schemas are the
  OpenAPI bodies and the MCP tools' input schemas;
* :func:`observation` and :func:`queries`: a validated request as the engine's token ids, text
  encoded with the companion's tokenizer, held to the limits in tokens;
* :data:`MAX_BODY`: bytes a request body (or MCP message over HTTP) may have;
* the one error shape, ``{"error": "<one line>"}`` (:func:`error_body`), the message of a
  request that does not validate (:func:`invalid`, naming the field) and the HTTP status and
  message of any exception a request raised (:func:`refusal`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field, StrictInt, StrictStr

from nested.companion.engine import Companion
from nested.companion.inputs import MAX_QUERIES, MAX_QUERY_TOKENS, MAX_TOKENS, CompanionError

MAX_BODY = 1 << 20  # bytes of a request body


class Observation(BaseModel):
    tokens: list[StrictInt] | None = Field(
        None, min_length=1, max_length=MAX_TOKENS, description="token ids (or text)"
    )
    text: StrictStr | None = Field(None, min_length=1, description="text to encode (or tokens)")


class Queries(BaseModel):
    queries: list[list[StrictInt]] | None = Field(
        None, min_length=1, max_length=MAX_QUERIES, description="token-id prefixes (or text)"
    )
    text: list[StrictStr] | None = Field(
        None, min_length=1, max_length=MAX_QUERIES, description="text prefixes (or queries)"
    )


def ids_or_text(body: BaseModel, ids: str) -> tuple[str, Any]:
    """``(field, value)`` of the one of ``ids`` (token ids) and ``text`` that ``body``
    carries; a :class:`CompanionError` when it carries both or neither."""
    given = [f for f in (ids, "text") if getattr(body, f) is not None]
    if len(given) != 1:
        start = f"{ids}: Field required; give" if not given else "give"
        raise CompanionError(
            f"{start} either {ids!r} (token ids) or 'text' (encoded with the companion's "
            f"tokenizer){', not both' if given else ''}"
        )
    return given[0], getattr(body, given[0])


def observation(companion: Companion, body: Observation) -> list[int]:
    """The token ids ``body`` observes: ``(n,)`` with ``n`` at most ``MAX_TOKENS`` and a
    multiple of the model's update period; else :class:`CompanionError` naming the field."""
    field, given = ids_or_text(body, "tokens")
    return companion.check_tokens(
        given, field, limit=MAX_TOKENS, multiple=companion.period
    ).tolist()


def queries(companion: Companion, body: Queries) -> list[list[int]]:
    """The token-id queries ``body`` recalls, each at most ``MAX_QUERY_TOKENS``; else
    :class:`CompanionError` naming the field (``queries.2``, ``text.0``)."""
    field, given = ids_or_text(body, "queries")
    return [
        companion.check_tokens(query, f"{field}.{i}", limit=MAX_QUERY_TOKENS).tolist()
        for i, query in enumerate(given)
    ]


def error_body(message: str) -> dict[str, str]:
    """The one error shape: ``{"error": message}``, the message on one line."""
    return {"error": " ".join(message.split())}


def invalid(errors: Sequence[Mapping[str, Any]]) -> str:
    """The message of a request that does not validate (pydantic's ``errors()``): its first
    error's field and reason, ``tokens.3: Input should be a valid integer``."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where}: {first.get('msg', 'invalid request')}"


def refusal(error: Exception) -> tuple[int, str]:
    """``(HTTP status, message)`` of an exception a request raised: a
    :class:`CompanionError` its own, a damaged database 503, anything else 500 (its cause is
    for the server's log, not the client)."""
    if isinstance(error, CompanionError):
        return error.status, str(error)
    if isinstance(error, sqlite3.DatabaseError):
        return 503, (
            f"the agents' store is damaged or unreadable (sqlite3: {error}); no agent can be "
            f"served until it is restored from a backup or repaired"
        )
    return 500, f"internal error ({type(error).__name__}); the cause is in the server's log"
