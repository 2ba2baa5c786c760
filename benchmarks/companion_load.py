"""Load on the companion service: many concurrent clients over hundreds of agents, and MCP
tool calls.

    .venv/bin/python benchmarks/companion_load.py --workdir runs/companion \
        [--clients 16 --agents 256 --rounds 4 --mcp_calls 64 --warm_s 900]

Starts the real server (``experiments/serve.py``) on loopback with a fresh SQLite store, having
it compile every bucket size a request can make before it serves (``--warm_s``: at most that
many seconds; the table's first line says how many sizes it warmed and how long it took), then
``--clients`` threads, each owning ``agents / clients`` agents, send ``--rounds`` rounds of one
observe (a sequence of the task: 16 events) and one recall (8 queries) per agent. Where the run
takes text (``configs/companion.py:text``), the same load runs again on as many other agents
with the same requests as text (``observe (text)``, ``recall (text)``: encoded by the server).
Then the server gives way to the MCP server of one agent (``--mcp=http``, on the same store),
and one MCP client (the SDK's, over streamable HTTP) calls its ``observe`` and ``recall``
tools ``--mcp_calls`` times each, one call at a time (``MCP observe``, ``MCP recall``). Every
request is timed by its client, from the first round on: with warm buckets no request waits
for a compile. No error is allowed and no update may be lost (each agent's tokens observed
must be what it was sent). Prints requests/s, tokens/s and the p50/p99 latency of each kind,
and writes the table into this benchmark's section of benchmarks/README.md (``--no-write``:
printed only). On a machine of 2 cores the clients and the server share them.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import report

from nested.companion.client import ServerProcess, mcp_session
from nested.run.loading import load_trained

MCP_AGENT = "mcp-agent"


def load(client, bodies: dict, clients: int, rounds: int, times: dict, errors: list) -> float:
    """``rounds`` rounds of each agent's requests (``bodies[agent][round]``: ``(kind, path,
    body)`` each) from ``clients`` threads, every request timed into ``times[kind]``; the
    wall-clock seconds."""
    agents, lock = list(bodies), threading.Lock()

    def run(mine: list[str]) -> None:
        for r in range(rounds):
            for name in mine:
                for kind, path, body in bodies[name][r]:
                    start = time.perf_counter()
                    status, content = client.request("POST", path, body)
                    seconds = time.perf_counter() - start
                    with lock:
                        times.setdefault(kind, []).append(seconds)
                        if status != 200:
                            errors.append(f"{kind} {name}: {status} {content}")

    threads = [threading.Thread(target=run, args=(agents[i::clients],)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


async def mcp_calls(url: str, sequences: list, queries: list, times: dict, errors: list):
    """Each of ``sequences`` observed and ``queries`` recalled through the MCP tools, one call
    at a time, timed into ``times``; the agent's tokens observed at the end."""
    async with mcp_session(url=url) as session:
        for observed, asked in zip(sequences, queries, strict=True):
            for kind, tool, arguments in (
                ("MCP observe", "observe", {"tokens": observed}),
                ("MCP recall", "recall", {"queries": asked}),
            ):
                start = time.perf_counter()
                result = await session.call_tool(tool, arguments)
                times.setdefault(kind, []).append(time.perf_counter() - start)
                if result.is_error:
                    errors.append(f"{kind}: {result.structured_content}")
        return (await session.call_tool("describe", {})).structured_content["tokens"]


def requests(name: str, sequences: list, queries: list, decode=None) -> list:
    """Agent ``name``'s rounds of ``(kind, path, body)``: an observe of each of ``sequences``
    (token ids) and a recall of the round's ``queries``; with ``decode``, the same as text."""
    observe, recall = f"/agents/{name}/observe", f"/agents/{name}/recall"
    if decode is None:
        return [
            [("observe", observe, {"tokens": o}), ("recall", recall, {"queries": q})]
            for o, q in zip(sequences, queries, strict=True)
        ]
    return [
        [
            ("observe (text)", observe, {"text": decode(o)}),
            ("recall (text)", recall, {"text": [decode(x) for x in q]}),
        ]
        for o, q in zip(sequences, queries, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/companion")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mcp_calls", type=int, default=64)
    parser.add_argument("--warm_s", type=float, default=900.0)
    report.add_flag(parser, "companion_load")
    args = parser.parse_args()
    out = report.Report(args.section)
    task = load_trained(args.workdir).experiment.task
    tokenizer = task.text_tokenizer() if hasattr(task, "text_tokenizer") else None
    rng = np.random.default_rng(0)

    def sequences(r: int, n: int) -> list[list[int]]:  # n sequences of the task's agent r
        return [task.encode(*task.sequence(task.agent(r, 0), 0, rng)).tolist() for _ in range(n)]

    agents = [f"agent-{i}" for i in range(args.agents)]
    observed = {name: sequences(r, args.rounds) for r, name in enumerate(agents)}
    rounds = max(args.rounds, args.mcp_calls)
    queries = [task.query_tokens(task.draw_inputs(rng, 8)).tolist() for _ in range(rounds)]
    asked = queries[: args.rounds]
    phases = [{name: requests(name, observed[name], asked) for name in agents}]
    if tokenizer is not None:  # the same requests as text, on as many other agents
        phases.append(
            {
                f"text-{name}": requests(f"text-{name}", observed[name], asked, tokenizer.decode)
                for name in agents
            }
        )
    times: dict[str, list[float]] = {}
    errors: list[str] = []
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        store = Path(scratch) / "load.sqlite"
        server = ServerProcess(args.workdir, store, warm_s=args.warm_s, timeout=args.warm_s + 180)
        warmed = server.started.split("(warmed ")[1].rstrip(")")
        for phase in phases:
            wall = load(server.client, phase, args.clients, args.rounds, times, errors)
            walls |= {kind: wall for kind, _, _ in next(iter(phase.values()))[0]}
        expected = args.rounds * task.seq_len
        lost = [n for phase in phases for n in phase if server.client.tokens(n) != expected]
        server.stop()
        mcp = ServerProcess(
            args.workdir,
            store,
            warm_s=args.warm_s,
            timeout=args.warm_s + 180,
            mcp_agent=MCP_AGENT,
        )
        began = time.perf_counter()
        mine = sequences(args.agents, args.mcp_calls)
        stored = asyncio.run(mcp_calls(mcp.url, mine, queries[: args.mcp_calls], times, errors))
        walls["MCP observe"] = walls["MCP recall"] = time.perf_counter() - began
        mcp.stop()
        if stored != args.mcp_calls * task.seq_len:
            lost.append(MCP_AGENT)
    if errors or lost:
        raise SystemExit(f"{len(errors)} errors (first: {errors[:1]}), {len(lost)} lost updates")
    count = sum(len(v) for v in times.values())
    text_note = ", then the same as text on as many agents" if tokenizer is not None else ""
    out.print(
        f"{args.clients} clients, {args.agents} agents, {args.rounds} rounds of one observe "
        f"({task.seq_len} tokens) and one recall (8 queries) per agent{text_note}, all timed, "
        f"on a server that warmed {warmed} at start; then one MCP client (streamable HTTP) "
        f"calling observe and recall {args.mcp_calls} times each, one at a time; {count} timed "
        f"requests, no error, no lost update"
    )
    out.print()
    out.print("| request | count | requests/s | p50 ms | p99 ms |")
    out.print("|---|---|---|---|---|")
    for kind, seconds in times.items():
        ms = 1e3 * np.array(seconds)
        out.print(
            f"| {kind} | {len(ms)} | {len(ms) / walls[kind]:.1f} | "
            f"{np.percentile(ms, 50):.1f} | {np.percentile(ms, 99):.1f} |"
        )
    out.print()
    ids_wall = walls["observe"]
    tokens = args.agents * args.rounds * task.seq_len
    out.print(f"Observed {tokens / ids_wall:.0f} tokens/s over all agents (token ids).")
    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
