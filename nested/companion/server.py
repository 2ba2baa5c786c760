"""The companion's HTTP service: FastAPI endpoints over a companion engine.

``python experiments/serve.py --workdir runs/companion --port 8080`` serves a trained run;
OpenAPI docs at ``/docs``. Endpoints (JSON unless said otherwise):

* ``GET /health``: status, agents stored, the model's fingerprint, vocabulary and tokenizer
  (its kind, or null: token ids only);
* ``POST /agents/{agent_id}/observe`` ``{"tokens": [...]}`` or ``{"text": "..."}``: learn
  from them;
* ``POST /agents/{agent_id}/recall`` ``{"queries": [[...], ...]}`` or ``{"text": ["...",
  ...]}``: predictions and read-outs (and, with a tokenizer, the predictions decoded, ``text``);
* ``POST /agents/{agent_id}/consolidate``: levels consolidating over a period apply now;
* ``GET /agents/{agent_id}``: tokens observed; ``DELETE /agents/{agent_id}``: forget;
* ``GET /agents/{agent_id}/export`` (bytes) and ``PUT /agents/{agent_id}/import`` (bytes).

Before any byte of a body is read, a pure ASGI gate (:class:`Gate`) refuses a request without
the server's API key when it has one (401, ``Authorization: Bearer <key>``; only ``/health``
and the docs are open), a path under ``/agents/`` whose agent id is not valid as sent or any
path with percent-escapes (400: ``victim/``, ``victim%2F``, ``..%2Fb``, ``/%61gents/b``; there
are no redirects), and a body announced over ``MAX_BODY`` bytes (413). It then reads the body
counting bytes whatever the framing (``Transfer-Encoding: chunked`` included) and refuses it
(413) as soon as the count passes the limit. Limits (:mod:`~nested.companion.checks`, the MCP
server's too): ``MAX_BODY`` bytes a body, ``MAX_TOKENS`` tokens an observe, ``MAX_QUERIES``
queries of ``MAX_QUERY_TOKENS`` tokens a recall (:mod:`~nested.companion.engine`), text counted
in the tokens it encodes to. Token ids are strict JSON integers (``1.0``, ``1e1``, ``"1"`` and
``true`` are not); a request carries ids or text, not both (422), and text needs the
companion's tokenizer (422 without one).

Model calls are queued and run by one worker thread: observes and recalls in **batches**
(consecutive requests of one kind, each agent at most once per batch: one jitted call for many
agents), every other write (consolidate, forget, import) and export alone, so an agent's
requests run in the order they arrived and never race with each other. A response is sent
once its batch is committed to the store, so an acknowledged observe survives the process
being killed. ``GET /health`` and ``GET /agents/{agent_id}`` need no model: they read the store
directly (its WAL journal gives them the last committed state), never waiting behind a model
call.

Every error is one line of JSON, ``{"error": "..."}``, and writes nothing: an invalid agent id
(400), a missing or wrong key (401), an unknown path (404) or method (405), a body over the
limit (413), a body that is not JSON, token ids that are not integers in the vocabulary, an
import that does not fit the model (422). An agent whose stored state is damaged, not finite
or of another model, or whose observe would make its state non-finite, gets 409; other agents
are served as usual. A damaged database file is a 503 saying so; anything unforeseen a 500
(the cause in the server's log).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import re
import sqlite3
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from nested.companion import checks
from nested.companion.checks import MAX_BODY, Observation, Queries
from nested.companion.engine import Companion, CompanionError, check_agent_id

ALONE = "alone"  # the kind of a queued request that runs by itself: its payload is a callable
OPEN = {"/health", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}  # no key needed
# The agent id of a path under /agents/: what lies between the prefix and the action, if any.
AGENT_PATH = re.compile(r"/agents/(?P<id>.*?)(?:/(?:observe|recall|consolidate|export|import))?")


class Batcher:
    """One worker thread running queued requests in batches (module docstring)."""

    def __init__(self, companion: Companion):
        self.companion = companion
        self.queue: collections.deque = collections.deque()
        self.ready = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="companion-batcher", daemon=True)
        self.thread.start()

    def submit(self, kind: str, agent_id: str, payload: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.ready:
            self.queue.append((kind, agent_id, payload, future))
            self.ready.notify()
        return future

    async def call(self, kind: str, agent_id: str, payload: Any) -> Any:
        """The result of one request, awaited in the event loop: ``kind`` ``"observe"`` or
        ``"recall"`` (``payload`` the agent's checked tokens or queries), or :data:`ALONE`
        (``payload()`` run in order with the agent's other requests)."""
        check_agent_id(agent_id)
        return await asyncio.wrap_future(self.submit(kind, agent_id, payload))

    async def served(self, kind: str, agent_id: str, payload: Any) -> dict:
        """:meth:`call` of an engine operation answering per agent (observe, recall, an
        :data:`ALONE` consolidate): ``{"agent_id": ..., **result}``, or a
        :class:`CompanionError` (409) when the engine refused that agent."""
        result = await self.call(kind, agent_id, payload)
        if "error" in result:
            raise CompanionError(result["error"], status=409)
        return {"agent_id": agent_id, **result}

    def stop(self) -> None:
        with self.ready:
            self.stopping = True
            self.ready.notify()
        self.thread.join()

    def _take(self) -> list:
        with self.ready:
            while not self.queue and not self.stopping:
                self.ready.wait()
            batch, agents = [], set()
            while self.queue and len(batch) < self.companion.max_batch:
                kind, agent_id = self.queue[0][:2]
                if batch and (kind != batch[0][0] or kind == ALONE or agent_id in agents):
                    break
                batch.append(self.queue.popleft())
                agents.add(agent_id)
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            kind = batch[0][0]
            if kind == ALONE:
                _, _, call, future = batch[0]
                try:
                    future.set_result(call())
                except Exception as error:  # noqa: BLE001 - the request learns of it
                    future.set_exception(error)
                continue
            run = self.companion.observe if kind == "observe" else self.companion.recall
            try:
                results = run({agent_id: payload for _, agent_id, payload, _ in batch})
            except Exception as error:  # noqa: BLE001 - every waiting request learns of it
                for *_, future in batch:
                    future.set_exception(error)
                continue
            for _, agent_id, _, future in batch:
                future.set_result(results[agent_id])


def health_report(companion: Companion) -> dict:
    """Status, agents stored, the model's fingerprint, vocabulary and tokenizer (its kind, or
    None: token ids only), read from the store directly (no model call)."""
    return {
        "status": "ok",
        "agents": companion.store.count(),
        "fingerprint": json.loads(companion.fingerprint),
        "vocab": companion.vocab,
        "tokenizer": None if companion.tokenizer is None else companion.tokenizer.kind,
    }


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(checks.error_body(message), status_code=status, headers=headers)


class Gate:
    """Pure ASGI middleware in front of the app: the key, the agent id and the body size are
    checked before any byte of the body is read; the body is then read with a running count
    and handed on whole (module docstring). ``api_key``: the bearer key, or ``None``."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            body, refusal = await self._read(receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if body is None:  # the client went away mid-body
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _refusal(self, scope) -> JSONResponse | None:
        headers = [(name.lower(), value) for name, value in scope["headers"]]
        if self.expected is not None and scope["path"] not in OPEN:
            given = [value for name, value in headers if name == b"authorization"]
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                return _error(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    {"www-authenticate": "Bearer"},
                )
        raw = (scope.get("raw_path") or scope["path"].encode()).split(b"?")[0].decode("latin-1")
        match = AGENT_PATH.fullmatch(raw)
        if match:
            try:
                check_agent_id(match["id"])
            except CompanionError as error:
                return _error(error.status, str(error))
        if "%" in raw:  # e.g. /%61gents/victim: no path of this service needs an escape
            return _error(400, f"path {raw!r:.60} has percent-escapes; no endpoint needs one")
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY:
                return _error(413, f"request body of {int(value)} bytes, over the limit {MAX_BODY}")
        return None

    async def _read(self, receive) -> tuple[bytes | None, JSONResponse | None]:
        """``(body, None)``; ``(None, 413)`` once over the limit; ``(None, None)`` when the
        client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return None, _error(413, f"request body over the limit {MAX_BODY} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def create_app(companion: Companion, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``companion`` (a bearer ``api_key``: required), behind
    its :class:`Gate`."""
    batcher: Batcher | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal batcher
        batcher = Batcher(companion)
        yield
        batcher.stop()

    app = FastAPI(
        title="nested companion",
        description="One learning fast-weight memory per agent beside a frozen model.",
        lifespan=lifespan,
        redirect_slashes=False,
    )
    app.add_middleware(Gate, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return _error(422, f"body: not valid JSON ({reason})")
        return _error(422, checks.invalid(error.errors()))

    @app.exception_handler(HTTPException)
    async def framework(request: Request, error: HTTPException):
        if error.status_code == 400 and error.__cause__ is not None:  # the body did not parse
            cause = error.__cause__
            return _error(422, f"body: not valid JSON ({type(cause).__name__}: {cause!s:.200})")
        if error.status_code == 404:
            return _error(404, f"no endpoint {request.url.path!r:.100}; the endpoints are at /docs")
        if error.status_code == 405:
            message = f"{request.method} is not a method of {request.url.path!r:.100}"
            return _error(405, message, error.headers)
        return _error(error.status_code, str(error.detail), error.headers)

    async def refused(request: Request, error: Exception):
        return _error(*checks.refusal(error))

    for refusable in (CompanionError, sqlite3.DatabaseError, Exception):
        app.add_exception_handler(refusable, refused)

    @app.get("/health")
    def health():  # in a thread of the server's pool: the store is read directly
        return health_report(companion)

    @app.post("/agents/{agent_id}/observe")
    async def observe(agent_id: str, body: Observation):
        return await batcher.served("observe", agent_id, checks.observation(companion, body))

    @app.post("/agents/{agent_id}/recall")
    async def recall(agent_id: str, body: Queries):
        return await batcher.served("recall", agent_id, checks.queries(companion, body))

    @app.post("/agents/{agent_id}/consolidate")
    async def consolidate(agent_id: str):
        return await batcher.served(
            ALONE, agent_id, lambda: companion.consolidate([agent_id])[agent_id]
        )

    @app.get("/agents/{agent_id}")
    def describe(agent_id: str):  # in a thread of the server's pool: the store read directly
        return {"agent_id": agent_id, "tokens": companion.tokens_observed(agent_id)}

    @app.delete("/agents/{agent_id}")
    async def forget(agent_id: str):
        forgotten = await batcher.call(ALONE, agent_id, lambda: companion.forget(agent_id))
        return {"agent_id": agent_id, "forgotten": forgotten}

    @app.get("/agents/{agent_id}/export")
    async def export(agent_id: str):
        data = await batcher.call(ALONE, agent_id, lambda: companion.export_agent(agent_id))
        return Response(data, media_type="application/octet-stream")

    @app.put("/agents/{agent_id}/import")
    async def import_(agent_id: str, request: Request):
        data = await request.body()
        tokens = await batcher.call(ALONE, agent_id, lambda: companion.import_agent(agent_id, data))
        return {"agent_id": agent_id, "tokens": tokens}

    return app
