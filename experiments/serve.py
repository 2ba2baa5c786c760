"""Serve a trained run as an Agent Companion: ``python experiments/serve.py --workdir DIR``.

Loads the latest checkpoint of ``--workdir`` (``--step``: that one; slow weights frozen) and
serves one learning fast-weight memory per agent over HTTP on ``--host``:``--port`` (default
loopback), the states in the SQLite database ``--store`` (default ``DIR/companion.sqlite``); with
``--api_key_file`` every request but ``/health`` and the docs needs ``Authorization: Bearer
<the file's key>``. Requests may carry text instead of token ids, encoded with
``--tokenizer`` (default the run's own tokenizer). Before serving, every bucket size a request
can make is compiled, cheapest first, for at most ``--warm_s`` seconds; the startup line says
how many and how long. A store that is damaged where opening it reads exits with one line.
OpenAPI docs at ``/docs``. Everything is in ``nested.companion``.

With ``--mcp`` it serves one agent, ``--agent``, as an MCP server instead
(``nested.companion.mcp_server``): ``--mcp=stdio`` over stdin/stdout (an MCP client spawns
this command; the lines above go to stderr), ``--mcp=http`` over streamable HTTP at
``http://127.0.0.1:PORT/mcp``, loopback only, ``--api_key_file`` as for the HTTP API. Flags
that do not go together end in one line before the model loads.
"""

import contextlib
import socket
import sqlite3
import sys
from pathlib import Path

import anyio
import uvicorn
from absl import flags

from nested.companion import engine, mcp_server, server
from nested.run import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the trained run to serve.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on.")
_PORT = flags.DEFINE_integer("port", 8080, "Port to listen on.")
_STORE = flags.DEFINE_string("store", None, "SQLite file of the agents' states.")
_KEY = flags.DEFINE_string("api_key_file", None, "File holding the bearer key (one line).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 256, "Most agents in one jitted call.")
_WARM_S = flags.DEFINE_float(
    "warm_s",
    120.0,
    "Seconds at most spent compiling the bucket sizes of requests before serving (0: none; "
    "sizes left compile at their first request).",
)
_OTHER_STEPS = flags.DEFINE_enum(
    "other_steps",
    "serve",
    list(engine.OTHER_STEPS),
    "Agents stored by the slow weights of another step (the run trained on since): serve "
    "them on these weights, or refuse them (409). Export works either way.",
)
_STEP = flags.DEFINE_integer(
    "step",
    None,
    "Serve the checkpoint of this step (default: the latest), e.g. the one that wrote the "
    "stored agents; the steps a store needs are kept from rotation by more training.",
)
_TOKENIZER = flags.DEFINE_string(
    "tokenizer",
    None,
    "What text requests are encoded with: bytes, or the path of a tokenizer.json (default: the "
    "run's own: its corpus's tokenizer.json, or the text companion task's words; none: token "
    "ids only).",
)
_MCP = flags.DEFINE_enum(
    "mcp",
    None,
    ["stdio", "http"],
    "Serve --agent as an MCP server over stdio or streamable HTTP (at /mcp, loopback only) "
    "instead of the HTTP API.",
)
_AGENT = flags.DEFINE_string("agent", None, "The agent an MCP server (--mcp) serves.")
flags.mark_flags_as_required(["workdir"])
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_mcp_flags() -> None:
    """Exit with one line when the MCP flags do not go together, before anything is loaded."""
    mode, agent = _MCP.value, _AGENT.value
    if mode is None and agent is not None:
        sys.exit(
            f"error: --agent={agent} names the agent of an MCP server: pass --mcp=stdio or "
            f"--mcp=http too (the HTTP API serves every agent)"
        )
    if mode is None:
        return
    if agent is None:
        sys.exit(f"error: --mcp={mode} serves one agent: pass --agent=<id>")
    try:
        engine.check_agent_id(agent)
    except engine.CompanionError as error:
        sys.exit(f"error: --agent: {error}")
    given = [f"--{f.name}" for f in (_HOST, _PORT, _KEY) if flags.FLAGS[f.name].present]
    if mode == "stdio" and given:
        sys.exit(
            f"error: --mcp=stdio talks over stdin and stdout: drop {', '.join(given)} (for "
            f"--mcp=http and the HTTP API)"
        )
    if mode == "http" and _HOST.value not in LOOPBACK:
        sys.exit(
            f"error: --mcp=http --host={_HOST.value}: the MCP server listens on loopback only; "
            f"pass --host=127.0.0.1 (or localhost, ::1)"
        )


def _check_port(host: str, port: int) -> None:
    """Exit with one line when ``host:port`` cannot be listened on (in use, not an address of
    this machine), before anything is loaded."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            sys.exit(
                f"error: --host={host} --port={port}: cannot listen there ({error.strerror}); "
                f"pass another --port (or stop what uses it)"
            )


def _start() -> tuple[engine.Companion, str | None]:
    """The flags checked, the companion loaded and warmed, its notes and the line saying
    where it serves printed; ``(companion, the API key or None)``."""
    _check_mcp_flags()
    key = None
    if _KEY.value is not None:
        path = Path(_KEY.value)
        if not path.is_file() or not path.read_text().strip():
            sys.exit(f"error: --api_key_file={_KEY.value}: no key there (one line of text)")
        key = path.read_text().strip()
    if _MCP.value != "stdio":
        _check_port(_HOST.value, _PORT.value)  # before the model loads
    try:
        companion = engine.Companion.open(
            _WORKDIR.value,
            _STORE.value,
            step=_STEP.value,
            max_batch=_MAX_BATCH.value,
            other_steps=_OTHER_STEPS.value,
            tokenizer=_TOKENIZER.value,
        )
        notes = companion.other_writers()
        if companion.tokenizer_error is not None:
            notes.append(f"no tokenizer ({companion.tokenizer_error}): token ids only")
    except engine.CompanionError as error:
        sys.exit(f"error: {error}")
    except sqlite3.DatabaseError as error:
        sys.exit(f"error: --store: the agents' store is damaged (sqlite3: {error})")
    for line in notes:
        print(f"note: {line}", flush=True)
    warmed, sizes, seconds = companion.warm(_WARM_S.value)
    where = f"http://{_HOST.value}:{_PORT.value}"
    if _MCP.value is not None:
        where = (
            f"MCP {'stdio' if _MCP.value == 'stdio' else where + '/mcp'} for agent {_AGENT.value}"
        )
    print(
        f"serving {_WORKDIR.value} on {where} (warmed {warmed} of {sizes} bucket sizes in "
        f"{seconds:.1f} s)",
        flush=True,
    )
    return companion, key


def main(argv):
    del argv
    with cli.user_errors():
        with contextlib.redirect_stdout(sys.stderr if _MCP.value == "stdio" else sys.stdout):
            companion, key = _start()  # over stdio, stdout is the protocol's
        if _MCP.value is None:
            app = server.create_app(companion, api_key=key)
        else:
            mcp = mcp_server.create_server(companion, _AGENT.value)
            if _MCP.value == "stdio":
                anyio.run(mcp_server.serve_stdio, mcp)
                return
            app = mcp_server.http_app(mcp, api_key=key, host=_HOST.value)
        uvicorn.run(app, host=_HOST.value, port=_PORT.value, log_level="warning")


if __name__ == "__main__":
    cli.run(main)
