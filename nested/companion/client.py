"""Clients of the companion service, and a launcher of the server process.

:class:`Client` speaks the endpoints of :mod:`nested.companion.server` with the standard
library only (``urllib``): ``observe``, ``recall``, ``consolidate``, ``tokens``, ``forget``,
``export``, ``import_``, ``health``; :meth:`Client.request` returns ``(status, body)`` for any call.
It never follows a redirect (the server sends none; one that did could send a request meant for
one agent to another): a 3xx is returned as it came. :func:`mcp_session` opens the MCP SDK's
``ClientSession`` with an agent's MCP server (:mod:`nested.companion.mcp_server`), over stdio
(spawning it) or streamable HTTP. :class:`ServerProcess` starts ``experiments/serve.py`` (the
HTTP API, or with ``mcp_agent`` an MCP server over HTTP) on loopback with a free port and
waits until it answers (the tests and ``benchmarks/companion_load.py`` use it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the MCP SDK is imported by mcp_session only: ~0.9 s the HTTP client skips
    import mcp

SERVE = Path(__file__).resolve().parents[2] / "experiments" / "serve.py"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # urllib then raises the 3xx as an HTTPError: returned by Client.request


_OPENER = urllib.request.build_opener(_NoRedirects)


class Client:
    """Requests to the server at ``base`` (``http://host:port``), with a bearer ``api_key``."""

    def __init__(self, base: str, api_key: str | None = None, timeout: float = 60.0):
        self.base, self.api_key, self.timeout = base.rstrip("/"), api_key, timeout

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None):
        """``(status, decoded JSON or bytes)`` of one call; HTTP errors are returned, not
        raised (connection errors are, a response cut off as ``ConnectionError``)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"content-type": "application/json"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                status, content = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, content = error.code, error.read()
        except http.client.HTTPException as error:  # a response cut off: a server killed
            raise ConnectionError(f"{method} {path}: the response broke off ({error!r})") from error
        try:
            return status, json.loads(content)
        except ValueError:
            return status, content

    def _ok(self, method: str, path: str, body: Any = None, raw: bytes | None = None):
        status, content = self.request(method, path, body, raw=raw)
        if status != 200:
            error = content.get("error") if isinstance(content, dict) else content
            raise RuntimeError(f"{method} {path}: HTTP {status}: {error}")
        return content

    def health(self) -> dict:
        return self._ok("GET", "/health")

    def observe(self, agent_id: str, tokens: list[int] | str) -> int:
        """Token ids, or text (sent as ``text``); returns the agent's tokens observed."""
        body = {"text": tokens} if isinstance(tokens, str) else {"tokens": tokens}
        return self._ok("POST", f"/agents/{agent_id}/observe", body)["tokens"]

    def recall(self, agent_id: str, queries: list[list[int]] | list[str]) -> dict:
        """Token-id queries, or text queries (all strings: sent as ``text``)."""
        texts = bool(queries) and all(isinstance(q, str) for q in queries)
        body = {"text": queries} if texts else {"queries": queries}
        return self._ok("POST", f"/agents/{agent_id}/recall", body)

    def consolidate(self, agent_id: str) -> int:
        return self._ok("POST", f"/agents/{agent_id}/consolidate")["tokens"]

    def tokens(self, agent_id: str) -> int:
        return self._ok("GET", f"/agents/{agent_id}")["tokens"]

    def forget(self, agent_id: str) -> bool:
        return self._ok("DELETE", f"/agents/{agent_id}")["forgotten"]

    def export(self, agent_id: str) -> bytes:
        return self._ok("GET", f"/agents/{agent_id}/export")

    def import_(self, agent_id: str, data: bytes) -> int:
        return self._ok("PUT", f"/agents/{agent_id}/import", raw=data)["tokens"]


@contextlib.asynccontextmanager
async def mcp_session(
    *,
    url: str | None = None,
    api_key: str | None = None,
    workdir: str | Path | None = None,
    agent: str | None = None,
    flags: Sequence[str] = (),
    errlog: IO | None = None,
) -> AsyncIterator[mcp.ClientSession]:
    """An initialized :class:`mcp.ClientSession` (the SDK's client; it negotiates the protocol
    version) with a companion's MCP server, closed on leaving: over streamable HTTP at ``url``
    (``http://127.0.0.1:PORT/mcp`` of ``serve.py --mcp=http``; ``api_key``: its bearer key), or
    over stdio with ``serve.py --mcp=stdio --workdir=workdir --agent=agent`` spawned (``flags``:
    its other flags, ``--store=...``; its stderr to ``errlog``, by default this process's; it
    inherits this process's environment) and ended with the session."""
    if (url is None) == (workdir is None) or (workdir is not None and agent is None):
        raise ValueError("mcp_session: give url (streamable HTTP) or workdir and agent (stdio)")
    import httpx2
    import mcp
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    async with contextlib.AsyncExitStack() as stack:
        if url is not None:
            headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
            timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's own client's
            http = await stack.enter_async_context(
                httpx2.AsyncClient(headers=headers, timeout=timeout)
            )
            transport = streamable_http_client(url, http_client=http)
        else:
            command = [str(SERVE), "--mcp=stdio", f"--workdir={workdir}", f"--agent={agent}"]
            spawned = StdioServerParameters(
                command=sys.executable, args=[*command, *flags], env=dict(os.environ)
            )
            transport = stdio_client(spawned, errlog=errlog or sys.stderr)
        client = await stack.enter_async_context(mcp.Client(transport))
        yield client.session


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``experiments/serve.py --workdir workdir --store store`` on ``127.0.0.1`` and a free
    port, started and waited for (``timeout`` seconds) until ``/health`` answers (any status:
    a damaged store answers 503); ``client`` talks to it, ``started`` is the line the server
    printed when it began serving (how long warming took), ``notes`` the lines before it.
    ``warm_s``: the server's ``--warm_s`` (0 here: a test starts many servers and needs no
    warm buckets); ``step``: its ``--step``; ``tokenizer``: its ``--tokenizer``; ``mcp_agent``:
    serve that agent as an MCP server over streamable HTTP (``--mcp=http``) at ``url``."""

    def __init__(
        self,
        workdir: str | Path,
        store: str | Path,
        *,
        api_key_file: str | Path | None = None,
        max_batch: int = 256,
        warm_s: float = 0.0,
        step: int | None = None,
        tokenizer: str | None = None,
        mcp_agent: str | None = None,
        timeout: float = 180.0,
    ):
        self.port, self.store = free_port(), Path(store)
        self.url = f"http://127.0.0.1:{self.port}" + ("" if mcp_agent is None else "/mcp")
        command = [
            sys.executable,
            str(SERVE),
            f"--workdir={workdir}",
            f"--store={store}",
            f"--port={self.port}",
            f"--max_batch={max_batch}",
            f"--warm_s={warm_s}",
        ]
        if api_key_file is not None:
            command.append(f"--api_key_file={api_key_file}")
        if step is not None:
            command.append(f"--step={step}")
        if tokenizer is not None:
            command.append(f"--tokenizer={tokenizer}")
        if mcp_agent is not None:
            command += ["--mcp=http", f"--agent={mcp_agent}"]
        self.notes: list[str] = []
        key = None if api_key_file is None else Path(api_key_file).read_text().strip()
        self.client = Client(f"http://127.0.0.1:{self.port}", key)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited: {self.process.stderr.read().decode()[-2000:]}"
                )
            try:
                self.client.request("GET", "/health")
            except OSError:
                time.sleep(0.2)
                continue
            for line in self.process.stdout:  # printed before it listened: notes, then this
                self.started = line.decode().strip()
                if self.started.startswith("serving "):
                    return
                self.notes.append(self.started)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"the server did not answer /health within {timeout} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` (SIGKILL: killed at once) and wait for the process."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.process.stderr.close()
