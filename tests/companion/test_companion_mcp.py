"""The companion's MCP server against the MCP SDK's own client: the real server process over
stdio and over streamable HTTP, on a real SQLite file, answering as the HTTP API does.

The tiny text-task run (``helpers.companion.text_run``) serves both token ids and text."""

import asyncio
import json
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers.companion import (
    KEY,
    assert_error_shape,
    events,
    http_request,
    text_run,
)
from mcp import MCPError

from nested.companion.checks import Observation, Queries
from nested.companion.client import SERVE, ServerProcess, mcp_session
from nested.run import loading


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return text_run(tmp_path_factory)


TOOLS = {"observe", "recall", "describe", "health", "forget", "export"}


def task(run):
    return loading.load_trained(run).experiment.task


def answer(result) -> dict:
    """A tool's JSON answer: its text content, which its structured content repeats."""
    assert len(result.content) == 1 and result.structured_content is not None
    content = json.loads(result.content[0].text)
    assert content == result.structured_content
    return content


async def call(session, tool, arguments=None) -> dict:
    """A successful call's answer."""
    result = await session.call_tool(tool, arguments or {})
    assert not result.is_error, result.content
    return answer(result)


async def refused(session, tool, arguments) -> str:
    """A refused call's error message (the HTTP API's error shape)."""
    result = await session.call_tool(tool, arguments)
    content = answer(result)
    assert result.is_error, content
    assert_error_shape(content)
    return content["error"]


def assert_same_recall(a, b):
    assert a["tokens"] == b["tokens"] and a.get("text") == b.get("text")
    np.testing.assert_allclose(a["probs"], b["probs"], rtol=1e-6)
    np.testing.assert_allclose(a["readout"], b["readout"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_stdio_tools_take_ids_or_text_and_refuse_in_the_error_shape(workdir, tmp_path):  # noqa: F811
    """Spawned by the SDK's stdio client: the tools and their schemas, text and ids answering
    alike, every bad argument a tool error naming the field, nothing written by one."""
    run_task = task(workdir)
    text, ids = events(run_task, 1)
    query = "the heavy light round box is"

    async def scenario():
        flags = [f"--store={tmp_path / 'agents.sqlite'}", "--warm_s=0"]
        async with mcp_session(workdir=workdir, agent="alice", flags=flags) as session:
            listed = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert set(listed) == TOOLS
            assert listed["observe"].input_schema == Observation.model_json_schema()
            assert listed["recall"].input_schema == Queries.model_json_schema()
            assert listed["forget"].annotations.destructive_hint
            assert await call(session, "observe", {"text": text}) == {
                "agent_id": "alice",
                "tokens": 32,
            }
            assert (await call(session, "health"))["tokenizer"] == "words"
            by_text = await call(session, "recall", {"text": [query]})
            encoded = run_task.text_tokenizer().encode(query).tolist()
            by_ids = await call(session, "recall", {"queries": [encoded]})
            assert_same_recall(by_text, by_ids)
            assert by_text["agent_id"] == "alice" and len(by_text["text"][0]) == 5
            bad = [
                ("observe", {"tokens": [1, 2, 99, 9]}, "tokens: token ids in [1, 99], outside"),
                ("observe", {"tokens": [1.0, 2, 3, 4]}, "tokens.0: Input should be a valid int"),
                ("observe", {"tokens": [[1, 2]]}, "tokens.0: Input should be a valid integer"),
                ("observe", {}, "tokens: Field required; give either 'tokens' (token ids) or"),
                ("observe", {"tokens": ids, "text": text}, "not both"),
                ("observe", {"text": "the " * 9000}, "text: 9000 tokens (the text's encoding)"),
                ("recall", {"text": [3]}, "text.0: Input should be a valid string"),
                ("recall", {"queries": [[1]] * 257}, "queries: List should have at most 256"),
                ("recall", {"text": ["the x purple box is"]}, "text.0: the tokenizer does not"),
                ("consolidate", {}, "no tool 'consolidate'; the tools are observe, recall"),
            ]
            for tool, arguments, message in bad:
                assert message in await refused(session, tool, arguments), (tool, arguments)
            assert await call(session, "describe") == {"agent_id": "alice", "tokens": 32}

    asyncio.run(scenario())


@pytest.mark.slow
def test_http_needs_the_key_and_a_restart_keeps_the_observation(workdir, tmp_path):  # noqa: F811
    """Over streamable HTTP: refused without the key before anything runs; an observe, the
    server killed (SIGKILL), the HTTP API on the store answers for the agent, and the MCP
    server restarted recalls exactly that."""
    key_file, store = tmp_path / "key", tmp_path / "agents.sqlite"
    key_file.write_text(KEY + "\n")
    _, ids = events(task(workdir), 2)
    queries = [ids[:7], ids[8:13]]
    served = ServerProcess(workdir, store, api_key_file=key_file, mcp_agent="bob")
    try:
        for key in (None, "nope"):
            status, headers, content = http_request(served, "POST", "/mcp", b"{}", key=key)
            assert status == 401 and headers["www-authenticate"] == "Bearer", content
            assert_error_shape(content)

        async def observe():
            with pytest.raises(ExceptionGroup) as info:
                async with mcp_session(url=served.url, api_key="nope") as session:
                    await session.list_tools()
            assert info.group_contains(MCPError)
            async with mcp_session(url=served.url, api_key=KEY) as session:
                assert set(t.name for t in (await session.list_tools()).tools) == TOOLS
                assert (await call(session, "observe", {"tokens": ids}))["tokens"] == 32
                message = await refused(session, "recall", {"queries": [[1, 2, 99]]})
                assert "queries.0: token ids in [1, 99], outside" in message

        asyncio.run(observe())
    finally:
        served.stop(signal.SIGKILL)
    http = ServerProcess(workdir, store, api_key_file=key_file)
    try:
        assert http.client.tokens("bob") == 32  # the acknowledged observe was on disk
        over_http = http.client.recall("bob", queries)
        fresh = http.client.recall("nobody", queries)
    finally:
        http.stop()
    assert over_http["probs"] != fresh["probs"]  # the observation changed the answers
    served = ServerProcess(workdir, store, api_key_file=key_file, mcp_agent="bob")
    try:

        async def recall():
            async with mcp_session(url=served.url, api_key=KEY) as session:
                assert_same_recall(await call(session, "recall", {"queries": queries}), over_http)
                assert (await call(session, "describe"))["tokens"] == 32
                exported = await call(session, "export")
                assert exported["bytes"] > 0 and len(exported["state"]) >= exported["bytes"]
                assert await call(session, "forget") == {"agent_id": "bob", "forgotten": True}
                assert (await call(session, "describe"))["tokens"] == 0

        asyncio.run(recall())
    finally:
        served.stop()


def serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SERVE), "--workdir=/nowhere", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        pytest.param(
            ["--mcp=stdio"],
            "error: --mcp=stdio serves one agent: pass --agent=<id>",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--agent=alice"],
            "error: --agent=alice names the agent of an MCP server: pass --mcp=stdio or",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--mcp=stdio", "--agent=alice", "--port=9000", "--api_key_file=key"],
            "error: --mcp=stdio talks over stdin and stdout: drop --port, --api_key_file (for",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--mcp=http", "--agent=alice", "--host=0.0.0.0"],
            "error: --mcp=http --host=0.0.0.0: the MCP server listens on loopback only",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--mcp=http", "--agent=a/b"],
            "error: --agent: agent id 'a/b' is not valid; use letters",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_flags_that_do_not_go_together_end_in_one_line_before_loading(flags, message):
    """Each refused before the model (of a workdir that does not exist) is looked for."""
    done = serve(*flags)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr
