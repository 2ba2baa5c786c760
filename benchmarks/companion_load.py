"""Load on the companion service: many concurrent clients over hundreds of agents.

    .venv/bin/python benchmarks/companion_load.py --workdir runs/companion \
        [--clients 16 --agents 256 --rounds 4 --warm_s 900]

Starts the real server (``experiments/serve.py``) on loopback with a fresh SQLite store, having
it compile every bucket size a request can make before it serves (``--warm_s``: at most that
many seconds; the table's first line says how many sizes it warmed and how long it took), then
``--clients`` threads, each owning ``agents / clients`` agents, send ``--rounds`` rounds of one
observe (a sequence of the task: 16 events) and one recall (8 queries) per agent. Every
request is timed by its client, from the first round on: with warm buckets no request waits
for a compile. No error is allowed and no update may be lost (each agent's tokens observed
must be ``rounds`` sequences). Prints requests/s, tokens/s and the p50/p99 latency of each
kind, and writes the table into this benchmark's section of benchmarks/README.md
(``--no-write``: printed only). On a machine of 2 cores the clients and the server share them.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import report

from nested.companion.client import ServerProcess
from nested.run.loading import load_trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/companion")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warm_s", type=float, default=900.0)
    report.add_flag(parser, "companion_load")
    args = parser.parse_args()
    out = report.Report(args.section)
    task = load_trained(args.workdir).experiment.task
    rng = np.random.default_rng(0)
    agents = [f"agent-{i}" for i in range(args.agents)]
    observations = {}
    for r, name in enumerate(agents):
        agent = task.agent(r, 0)
        observations[name] = [
            task.encode(*task.sequence(agent, 0, rng)).tolist() for _ in range(args.rounds)
        ]
    queries = [task.query_tokens(task.draw_inputs(rng, 8)).tolist() for _ in range(args.rounds)]
    with tempfile.TemporaryDirectory() as scratch:
        server = ServerProcess(
            args.workdir,
            Path(scratch) / "load.sqlite",
            warm_s=args.warm_s,
            timeout=args.warm_s + 180,
        )
        warmed = server.started.split("(warmed ")[1].rstrip(")")
        client = server.client
        times: dict[str, list[float]] = {"observe": [], "recall": []}
        errors: list[str] = []
        lock = threading.Lock()

        def run(mine: list[str], rounds: range) -> None:
            for r in rounds:
                for name in mine:
                    for kind, path, body in (
                        ("observe", f"/agents/{name}/observe", {"tokens": observations[name][r]}),
                        ("recall", f"/agents/{name}/recall", {"queries": queries[r]}),
                    ):
                        start = time.perf_counter()
                        status, content = client.request("POST", path, body)
                        seconds = time.perf_counter() - start
                        with lock:
                            times[kind].append(seconds)
                            if status != 200:
                                errors.append(f"{kind} {name}: {status} {content}")

        def load(rounds: range) -> float:
            threads = [
                threading.Thread(target=run, args=(agents[i :: args.clients], rounds))
                for i in range(args.clients)
            ]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - start

        wall = load(range(args.rounds))
        lost = [n for n in agents if client.tokens(n) != args.rounds * task.seq_len]
        count = sum(len(v) for v in times.values())
        server.stop()
    if errors or lost:
        raise SystemExit(f"{len(errors)} errors (first: {errors[:1]}), {len(lost)} lost updates")
    out.print(
        f"{args.clients} clients, {args.agents} agents, {args.rounds} rounds of one observe "
        f"({task.seq_len} tokens) and one recall (8 queries) per agent, all timed, on a server "
        f"that warmed {warmed} at start; {count} timed requests in {wall:.1f} s, no error, no "
        f"lost update"
    )
    out.print()
    out.print("| request | count | requests/s | p50 ms | p99 ms |")
    out.print("|---|---|---|---|---|")
    for kind, seconds in times.items():
        ms = 1e3 * np.array(seconds)
        out.print(
            f"| {kind} | {len(ms)} | {len(ms) / wall:.1f} | {np.percentile(ms, 50):.1f} | "
            f"{np.percentile(ms, 99):.1f} |"
        )
    tokens = args.agents * args.rounds * task.seq_len
    out.print(f"| all | {count} | {count / wall:.1f} | | |")
    out.print()
    out.print(f"Observed {tokens / wall:.0f} tokens/s over all agents.")
    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
