"""What the benchmarks share: a median timer, the machine's matmul rate, the PyTorch peers.

The benchmarks run as scripts (``python benchmarks/x.py``), so this module is imported by name
from the scripts' own folder.
"""

import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

# The peers' harness, beside the repository (``../shared/peers``).
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers")


def median_seconds(fn, args, runs: int) -> float:
    """Median wall seconds of ``fn(*args)`` over ``runs`` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_seconds(fns, args, runs: int) -> list[tuple[float, ...]]:
    """Wall seconds of each ``fn(*args)`` of ``fns``, called in turn ``runs`` times after a
    warm-up call each: one tuple per turn, so ratios between them are taken seconds apart."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    turns = []
    for _ in range(runs):
        times = []
        for fn in fns:
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        turns.append(tuple(times))
    return turns


def matmul_gflops(n: int = 2048) -> float:
    """This machine's float32 ``n x n`` matmul rate in GFLOP/s (``2 n^3`` flops a product)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    return 2 * n**3 / median_seconds(jax.jit(lambda a: a @ a), (a,), 7) / 1e9


def peer_rows(t: int, runs: int) -> dict:
    """The PyTorch peers measured at sequence length ``t`` by ``PEERS/bench_peers.py``, run
    with the interpreter ``PEERS/setup.sh`` prints last (its JSON line, parsed)."""
    setup = subprocess.run(
        ["bash", os.path.join(PEERS, "setup.sh")], capture_output=True, text=True, check=True
    )
    python = setup.stdout.split()[-1]
    out = subprocess.run(
        [python, os.path.join(PEERS, "bench_peers.py"), "--T", str(t), "--runs", str(runs)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])
