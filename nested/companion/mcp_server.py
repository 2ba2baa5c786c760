"""The companion as an MCP server: one agent's learning memory as tools of the Model Context
Protocol, made with the official ``mcp`` SDK (its low-level :class:`mcp.server.Server`).

``python experiments/serve.py --workdir DIR --agent alice --mcp=stdio`` (a client spawns it)
or ``--mcp=http`` (streamable HTTP at ``http://127.0.0.1:PORT/mcp``) serves the agent chosen
at start. Its tools, each answering JSON (the result's text and its structured content) as
the HTTP API of :mod:`~nested.companion.server` does for that agent:

* ``observe`` ``{"tokens": [...]}`` or ``{"text": "..."}``: learn from them; the agent's
  tokens observed in all;
* ``recall`` ``{"queries": [[...], ...]}`` or ``{"text": ["...", ...]}``: each query's top
  next tokens, their probabilities (and, with a tokenizer, ``text``) and the memories'
  read-out, from the agent's state; nothing written;
* ``describe``: tokens observed; ``health``: the service's status, model and tokenizer;
* ``forget``: remove the agent's state; ``export``: the state file, base64 in ``state``.

The arguments are checked by the HTTP API's request models and limits
(:mod:`~nested.companion.checks`: ids or text, strict integers, 8192 tokens an observe, 256
queries of 512 tokens a recall); a refused call is a tool error (``isError``) whose content is
the HTTP API's error JSON, ``{"error": "<one line naming the field and the fix>"}``, and it
writes nothing. The engine runs in the HTTP server's worker thread
(:class:`~nested.companion.server.Batcher`, started and stopped by the server's lifespan), so
an answered observe is committed to the store. Over HTTP the app sits behind the HTTP API's
:class:`~nested.companion.server.Gate`: the same bearer key (401 before any byte of a body
is read) and body limit; the SDK adds its DNS-rebinding protection on loopback.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from typing import Any

import anyio
from mcp import types
from mcp.server import Server
from mcp.server.stdio import stdio_server
from pydantic import ValidationError

from nested.companion import checks
from nested.companion.engine import Companion
from nested.companion.inputs import MAX_QUERIES, MAX_QUERY_TOKENS, MAX_TOKENS, check_agent_id
from nested.companion.server import ALONE, Batcher, Gate, health_report

NO_ARGUMENTS = {"type": "object", "properties": {}}
READ = types.ToolAnnotations(read_only_hint=True, open_world_hint=False)
log = logging.getLogger(__name__)


def _tools(companion: Companion, agent_id: str) -> list[types.Tool]:
    """The tools: name, what it does, its input schema and hints (read-only: writes nothing)."""
    you = f"agent {agent_id!r}"
    writes = types.ToolAnnotations(destructive_hint=False, open_world_hint=False)
    table = [
        (
            "observe",
            f"Learn from new events of {you}: 'tokens' (token ids) or 'text' (a string), at "
            f"most {MAX_TOKENS} tokens, a multiple of {companion.period}. Answers the tokens "
            f"the agent has observed in all.",
            checks.Observation.model_json_schema(),
            writes,
        ),
        (
            "recall",
            f"Ask {you}'s memory: for each query ('queries': token-id lists, or 'text': "
            f"strings; at most {MAX_QUERIES} of {MAX_QUERY_TOKENS} tokens), the top next "
            f"tokens, their probabilities (and the tokens as 'text') and the memories' "
            f"read-out. Writes nothing.",
            checks.Queries.model_json_schema(),
            READ,
        ),
        ("describe", f"The tokens {you} has observed.", NO_ARGUMENTS, READ),
        (
            "health",
            "The service's status, agents stored, model fingerprint and tokenizer.",
            NO_ARGUMENTS,
            READ,
        ),
        (
            "forget",
            f"Forget {you}: its state is removed; it starts over from the learned initial state.",
            NO_ARGUMENTS,
            types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
        ),
        (
            "export",
            f"The state of {you} as a portable file (flax msgpack with the model's "
            f"fingerprint), base64 in 'state'; the HTTP API's PUT /agents/{{id}}/import takes "
            f"it back.",
            NO_ARGUMENTS,
            READ,
        ),
    ]
    return [
        types.Tool(name=name, description=text, input_schema=schema, annotations=hints)
        for name, text, schema, hints in table
    ]


def _result(content: dict, error: bool = False) -> types.CallToolResult:
    text = types.TextContent(type="text", text=json.dumps(content))
    return types.CallToolResult(content=[text], structured_content=content, is_error=error)


def create_server(companion: Companion, agent_id: str) -> Server:
    """The MCP server of ``companion``'s agent ``agent_id`` (module docstring); its lifespan
    runs a :class:`Batcher` for ``companion``."""
    check_agent_id(agent_id)
    tools = _tools(companion, agent_id)
    names = [tool.name for tool in tools]

    @contextlib.asynccontextmanager
    async def lifespan(server: Server):
        batcher = Batcher(companion)
        try:
            yield batcher
        finally:
            batcher.stop()

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def run(batcher: Batcher, name: str, arguments: dict[str, Any]) -> dict:
        if name == "observe":
            tokens = checks.observation(companion, checks.Observation.model_validate(arguments))
            return await batcher.served("observe", agent_id, tokens)
        if name == "recall":
            queries = checks.queries(companion, checks.Queries.model_validate(arguments))
            return await batcher.served("recall", agent_id, queries)
        if name == "describe":  # the store read directly, as GET /agents/{id}
            tokens = await anyio.to_thread.run_sync(companion.tokens_observed, agent_id)
            return {"agent_id": agent_id, "tokens": tokens}
        if name == "health":
            return await anyio.to_thread.run_sync(health_report, companion)
        if name == "forget":
            forgotten = await batcher.call(ALONE, agent_id, lambda: companion.forget(agent_id))
            return {"agent_id": agent_id, "forgotten": forgotten}
        data = await batcher.call(ALONE, agent_id, lambda: companion.export_agent(agent_id))
        return {"agent_id": agent_id, "bytes": len(data), "state": base64.b64encode(data).decode()}

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in names:
            message = f"no tool {params.name!r:.60}; the tools are {', '.join(names)}"
            return _result(checks.error_body(message), error=True)
        try:
            return _result(await run(ctx.lifespan_context, params.name, params.arguments or {}))
        except ValidationError as error:
            return _result(checks.error_body(checks.invalid(error.errors())), error=True)
        except Exception as error:  # noqa: BLE001 - every refusal is a tool error of one shape
            status, message = checks.refusal(error)
            if status == 500:
                log.exception("tool %s failed", params.name)
            return _result(checks.error_body(message), error=True)

    return Server(
        "nested-companion",
        instructions=(
            f"The learning memory of agent {agent_id!r}: observe its events (token ids or text), "
            f"recall predictions from what it learned, describe, forget or export it."
        ),
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(server: Server) -> None:
    """Serve ``server`` over this process's stdin and stdout until stdin closes."""
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def http_app(server: Server, *, api_key: str | None = None, host: str = "127.0.0.1"):
    """The ASGI app serving ``server`` over streamable HTTP at ``/mcp`` on loopback ``host``,
    behind the HTTP API's :class:`Gate` (``api_key``: the bearer key every request needs)."""
    app = server.streamable_http_app(host=host, max_request_body_size=checks.MAX_BODY)
    return Gate(app, api_key)
