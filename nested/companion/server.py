"""The companion's HTTP service: FastAPI endpoints over a companion engine.

``python experiments/serve.py --workdir runs/companion --port 8080`` serves a trained run;
OpenAPI docs at ``/docs``. Endpoints (JSON unless said otherwise):

* ``GET /health``: status, agents stored, the model's fingerprint and vocabulary;
* ``POST /agents/{agent_id}/observe`` ``{"tokens": [...]}``: learn from them;
* ``POST /agents/{agent_id}/recall`` ``{"queries": [[...], ...]}``: predictions and read-outs;
* ``POST /agents/{agent_id}/consolidate``: levels consolidating over a period apply now;
* ``GET /agents/{agent_id}``: tokens observed; ``DELETE /agents/{agent_id}``: forget;
* ``GET /agents/{agent_id}/export`` (bytes) and ``PUT /agents/{agent_id}/import`` (bytes).

Requests are queued and run by one worker thread: observes and recalls in **batches**
(consecutive requests of one kind, each agent at most once per batch: one jitted call for many
agents), every other request alone, so an agent's requests run in the order they arrived and
never race with each other. A response is sent once its batch is committed to the store,
so an acknowledged observe survives the process being killed. Bad input gets a 4xx with a
one-line ``{"error": ...}`` and writes nothing: an invalid agent id (400), token ids outside
the vocabulary or a malformed body (422), a body over the size limit (413), a missing or
wrong API key when the server has one (401, ``Authorization: Bearer <key>``). An agent whose
stored state is damaged or of another model gets 409; other agents are served as usual.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import threading
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from nested.companion.engine import (
    MAX_QUERIES,
    MAX_QUERY_TOKENS,
    MAX_TOKENS,
    Companion,
    CompanionError,
    check_agent_id,
)

MAX_BODY = 1 << 20  # bytes of a request body
ALONE = "alone"  # the kind of a queued request that runs by itself: its payload is a callable


class Observation(BaseModel):
    tokens: list[int] = Field(min_length=1, max_length=MAX_TOKENS, description="token ids")


class Queries(BaseModel):
    queries: list[list[int]] = Field(
        min_length=1, max_length=MAX_QUERIES, description="token-id prefixes to continue"
    )


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


class _Unauthorized(Exception):
    """A request without the server's API key."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


def create_app(companion: Companion, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``companion`` (a bearer ``api_key``: required)."""
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
    )

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            return _error(413, f"request body of {size} bytes, more than the limit {MAX_BODY}")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(422, f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(CompanionError)
    async def refused(request: Request, error: CompanionError):
        return _error(error.status, str(error))

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, error: Exception):
        return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def run(kind: str, agent_id: str, payload: Any):
        check_agent_id(agent_id)
        result = await asyncio.wrap_future(batcher.submit(kind, agent_id, payload))
        if "error" in result:
            return _error(409, result["error"])
        return {"agent_id": agent_id, **result}

    async def alone(agent_id: str, call):
        """``call()`` in the worker thread, in order with the agent's other requests."""
        check_agent_id(agent_id)
        return await asyncio.wrap_future(batcher.submit(ALONE, agent_id, call))

    guard = [Depends(authorized)]

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "agents": companion.store.count(),
            "fingerprint": json.loads(companion.fingerprint),
            "vocab": companion.vocab,
        }

    @app.post("/agents/{agent_id}/observe", dependencies=guard)
    async def observe(agent_id: str, body: Observation):
        companion.check_tokens(body.tokens, "tokens", limit=MAX_TOKENS, multiple=companion.period)
        return await run("observe", agent_id, body.tokens)

    @app.post("/agents/{agent_id}/recall", dependencies=guard)
    async def recall(agent_id: str, body: Queries):
        for i, query in enumerate(body.queries):
            companion.check_tokens(query, f"queries.{i}", limit=MAX_QUERY_TOKENS)
        return await run("recall", agent_id, body.queries)

    @app.post("/agents/{agent_id}/consolidate", dependencies=guard)
    async def consolidate(agent_id: str):
        result = await alone(agent_id, lambda: companion.consolidate([agent_id])[agent_id])
        if "error" in result:
            return _error(409, result["error"])
        return {"agent_id": agent_id, **result}

    @app.get("/agents/{agent_id}", dependencies=guard)
    async def describe(agent_id: str):
        tokens = await alone(agent_id, lambda: companion.tokens_observed(agent_id))
        return {"agent_id": agent_id, "tokens": tokens}

    @app.delete("/agents/{agent_id}", dependencies=guard)
    async def forget(agent_id: str):
        forgotten = await alone(agent_id, lambda: companion.forget(agent_id))
        return {"agent_id": agent_id, "forgotten": forgotten}

    @app.get("/agents/{agent_id}/export", dependencies=guard)
    async def export(agent_id: str):
        data = await alone(agent_id, lambda: companion.export_agent(agent_id))
        return Response(data, media_type="application/octet-stream")

    @app.put("/agents/{agent_id}/import", dependencies=guard)
    async def import_(agent_id: str, request: Request):
        data = await request.body()
        tokens = await alone(agent_id, lambda: companion.import_agent(agent_id, data))
        return {"agent_id": agent_id, "tokens": tokens}

    return app
