"""Forward+backward throughput of the linear-memory ops: chunked default path vs per-token scan.

    .venv/bin/python benchmarks/ops_throughput.py                  # T = 1024 and 4096
    .venv/bin/python benchmarks/ops_throughput.py --T 1024 --peers  # + PyTorch peers, same job
    .venv/bin/python benchmarks/ops_throughput.py --ops delta_rule --T 4096 --chunks 16 32 64
    .venv/bin/python benchmarks/ops_throughput.py --T 64 --runs 1 --ops delta_rule --no-write

For every op at B=4, H=4, d_k=d_v=64 (float32): tokens/s (B*T / median seconds of a jitted
gradient of ``sum(o) + sum(final_state)`` w.r.t. every input, after a warm-up) of the default path
(``chunk_size=None``) and of the per-token ``lax.scan`` (``chunk_size=1``), their ratio, and the
temporary memory XLA allocates for each compiled program. The float32 2048x2048 matmul rate is
measured in the same run, so rows can be read as a fraction of this machine's peak. ``--peers``
runs ../shared/peers/bench_peers.py in its own torch venv and prints its rows next to ours.
``ttt_linear``'s chunk is semantic (mini-batch 16 vs online SGD), so its ratio compares two rules,
as do the rows of the two neural ops with document paths, TTT-MLP and Titans (a two-layer MLP
memory of width D, mini-batch 16; per token: the online rule).

The cost of document boundaries (packed rows, ``nested.ops.documents``): the default path again
with ``starts``, four documents a row of about T / 4 tokens whose lengths are no multiple of a
chunk (the gradient also w.r.t. the state they start from), timed in turns with the same path
without starts, and the median ratio of their times; then with the documents on the grid of 64
tokens (every chunk and mini-batch here divides it), as the task ``tokens`` lays them out, and
declared so (``nested.ops.documents.on_grid``, as a program compiled with the task's grid
does): the ops restart at chunk starts and run without segments (``--no-documents``: skipped;
Falcon-3's window has no document path, n/a).
The tables go into this benchmark's section of benchmarks/README.md (``--no-write``: printed only).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import report
import timing

from nested import ops
from nested.ops import documents

B, H, D = 4, 4, 64
GRID = 64  # the grid of the aligned documents: every chunk and mini-batch here divides it


def make_inputs(t, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
    k = normal(B, t, H, D)
    gate = normal(B, t, H, D)
    return {
        "q": normal(B, t, H, D),
        "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        "v": normal(B, t, H, D),
        "beta": jax.nn.sigmoid(gate[..., 0]),
        "beta_rows": jax.nn.sigmoid(gate),
        "log_alpha": -jax.nn.softplus(gate[..., 1] - 2.0),
        "lam": jax.nn.softplus(gate[..., 2]),
        "erase": jax.nn.sigmoid(gate[..., ::-1]),
        "write": jax.nn.sigmoid(normal(B, t, H, D)),
        "log_decay": -jax.nn.softplus(normal(B, t, H, D) - 2.0),
        "starts": document_starts(t),
        "starts_on_grid": document_starts(t, grid=GRID),
        "start_state": 0.1 * normal(B, H, D, D),
        "lr": 0.1 * jax.nn.sigmoid(gate[..., 3]),
        "momentum": jax.nn.sigmoid(gate[..., 4]),
        "decay": 0.01 * jax.nn.sigmoid(gate[..., 5]),
        "mlp": mlp(next(keys)),
        "mlp_start": mlp(next(keys)),
    }


def mlp(key):
    """A two-layer MLP memory (hidden width D) for every batch row and head."""
    return ops.init_mlp_memory(key, batch=B, heads=H, d_in=D, d_out=D, hidden=D)


def document_starts(t, grid=None):
    """(B, T) bool: documents of about t / 4 tokens, shifted by a few tokens row by row so that
    no length is a multiple of a chunk; with ``grid``, at multiples of it (shifted by a grid
    step row by row)."""
    starts = np.zeros((B, t), bool)
    for row in range(B):
        positions = [j * t // 4 + 3 * row + 5 for j in range(1, 4)]
        if grid is not None:
            positions = [(j * t // 4 // grid + row) * grid for j in range(1, 4)]
        starts[row, [p for p in positions if 0 < p < t]] = True
    return jnp.asarray(starts)


# name -> (op(inputs, chunk_size[, starts=, start_state=]), the inputs it reads and
# differentiates, the input the documents after the first start from: None where the op has
# no document path).
OPS = {
    "linear_attention": (
        lambda a, c, **d: ops.linear_attention(a["q"], a["k"], a["v"], chunk_size=c, **d),
        ("q", "k", "v"),
        "start_state",
    ),
    "delta_rule": (
        lambda a, c, **d: ops.delta_rule(a["q"], a["k"], a["v"], a["beta"], chunk_size=c, **d),
        ("q", "k", "v", "beta"),
        "start_state",
    ),
    "gated_delta_rule": (
        lambda a, c, **d: ops.gated_delta_rule(
            a["q"], a["k"], a["v"], a["beta"], log_alpha=a["log_alpha"], chunk_size=c, **d
        ),
        ("q", "k", "v", "beta", "log_alpha"),
        "start_state",
    ),
    "falcon (1)": (
        lambda a, c, **d: ops.falcon(
            a["q"], a["k"], a["v"], a["beta"], a["lam"], chunk_size=c, **d
        ),
        ("q", "k", "v", "beta", "lam"),
        "start_state",
    ),
    "falcon (2: per-channel)": (
        lambda a, c, **d: ops.falcon(
            a["q"], a["k"], a["v"], a["beta_rows"], a["lam"], chunk_size=c, **d
        ),
        ("q", "k", "v", "beta_rows", "lam"),
        "start_state",
    ),
    "falcon (3: window 4)": (
        lambda a, c: ops.falcon(
            a["q"], a["k"], a["v"], a["beta"], a["lam"], window=4, chunk_size=c
        ),
        ("q", "k", "v", "beta", "lam"),
        None,
    ),
    "gdn2": (
        lambda a, c, **d: ops.gdn2(
            a["q"], a["k"], a["v"], a["erase"], a["write"], a["log_decay"], chunk_size=c, **d
        ),
        ("q", "k", "v", "erase", "write", "log_decay"),
        "start_state",
    ),
    "ttt_linear (mini-batch 16)": (
        lambda a, c, **d: ops.ttt_linear(
            a["q"], a["k"], a["v"], a["beta"], initial_state=None, chunk_size=c or 16, **d
        ),
        ("q", "k", "v", "beta"),
        "start_state",
    ),
    "ttt_mlp (mini-batch 16)": (
        lambda a, c, starts=None, start_state=None: ops.ttt_mlp(
            a["q"],
            a["k"],
            a["v"],
            a["lr"],
            params=a["mlp"],
            chunk_size=c or 16,
            starts=starts,
            start_params=start_state,
        ),
        ("q", "k", "v", "lr", "mlp"),
        "mlp_start",
    ),
    "titans (mini-batch 16)": (
        lambda a, c, starts=None, start_state=None: ops.titans(
            a["q"],
            a["k"],
            a["v"],
            a["lr"],
            a["momentum"],
            a["decay"],
            state=ops.titans_state(a["mlp"]),
            chunk_size=c or 16,
            starts=starts,
            start_state=None if start_state is None else ops.titans_state(start_state),
        ),
        ("q", "k", "v", "lr", "momentum", "decay", "mlp"),
        "mlp_start",
    ),
}


def gradient(op, names, inputs, chunk, start=None, starts="starts", grid=1):
    """The compiled forward+backward pass and its argument: the gradient of ``sum(o) +
    sum(final_state)`` w.r.t. the inputs ``names`` (and with documents, where the input
    ``starts`` says, the input ``start`` they start from, declared on ``grid``)."""
    names = names if start is None else (*names, start)
    rest = {n: x for n, x in inputs.items() if n not in names}

    def loss(diff):
        a = {**rest, **diff}
        keywords = {} if start is None else {"starts": a[starts], "start_state": a[start]}
        o, state = op(a, chunk, **keywords)
        return jnp.sum(o) + sum(jnp.sum(x) for x in jax.tree.leaves(state))

    diff = {n: inputs[n] for n in names}
    with documents.on_grid(grid):
        return jax.jit(jax.grad(loss)).lower(diff).compile(), diff


def measure(op, names, inputs, chunk, runs):
    """(tokens/s, temporary MiB) of the jitted forward+backward pass."""
    compiled, diff = gradient(op, names, inputs, chunk)
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    seconds = timing.median_seconds(compiled, (diff,), runs)
    return B * inputs["q"].shape[1] / seconds, temp


def measure_documents(op, names, start, inputs, runs):
    """(tokens/s with starts, median time ratio with / without starts, the same with the starts
    on the grid) of the default path, the three programs timed in turns (the same load)."""
    plain, diff = gradient(op, names, inputs, None)
    packed, packed_diff = gradient(op, names, inputs, None, start)
    grid, grid_diff = gradient(op, names, inputs, None, start, "starts_on_grid", GRID)
    calls = (lambda: plain(diff), lambda: packed(packed_diff), lambda: grid(grid_diff))
    turns = timing.paired_seconds(calls, (), runs)
    seconds = float(np.median([t for _, t, _ in turns]))
    ratio = lambda i: float(np.median([times[i] / times[0] for times in turns]))
    return B * inputs["q"].shape[1] / seconds, ratio(1), ratio(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), metavar="OP")
    parser.add_argument("--chunks", type=int, nargs="*", default=[], help="extra chunk sizes")
    parser.add_argument("--no-per-token", action="store_true", help="skip chunk_size=1 rows")
    parser.add_argument("--peers", action="store_true", help="also run the PyTorch peers")
    parser.add_argument("--no-documents", action="store_true", help="skip the starts columns")
    report.add_flag(parser, "ops_throughput")
    args = parser.parse_args()

    out = report.Report(args.section)
    out.print(f"B={B}, H={H}, d_k=d_v={D}, float32, forward+backward\n")
    header = ["op", "T", "default tok/s", "per-token tok/s", "default / per-token"]
    if not args.no_documents:
        header += ["with starts tok/s", "time with / without starts", "on the grid / without"]
    header += [f"C={c} tok/s" for c in args.chunks]
    header += ["default temp MiB", "per-token temp MiB"]
    out.print("| " + " | ".join(header) + " |")
    out.print("|" + "---|" * len(header))
    ours = {}
    for t in args.T:
        inputs = make_inputs(t)
        for name in args.ops:
            op, names, start = OPS[name]
            fast, fast_mem = measure(op, names, inputs, None, args.runs)
            ours[(name, t)] = fast
            swept = [measure(op, names, inputs, c, args.runs)[0] for c in args.chunks]
            slow, slow_mem = float("nan"), float("nan")
            if not args.no_per_token:
                slow, slow_mem = measure(op, names, inputs, 1, args.runs)
            row = [name, str(t), f"{fast:,.0f}", f"{slow:,.0f}", f"{fast / slow:.1f}x"]
            if not args.no_documents:
                row += ["n/a", "n/a", "n/a"]
                if start is not None:
                    packed, cost, aligned = measure_documents(op, names, start, inputs, args.runs)
                    row[-3:] = [f"{packed:,.0f}", f"{cost:.2f}x", f"{aligned:.2f}x"]
            row += [f"{rate:,.0f}" for rate in swept]
            row += [f"{fast_mem:.0f}", f"{slow_mem:.0f}"]
            out.print("| " + " | ".join(row) + " |")

    if args.peers:
        out.print("\nPyTorch peers, same job (fla-core's pure-PyTorch chunkwise delta rule):\n")
        out.print("| peer | T | peer tok/s | our delta_rule default tok/s | ours / peer |")
        out.print("|---|---|---|---|---|")
        for result in (timing.peer_rows(t, args.runs) for t in args.T):
            t = result["T"]
            mine = ours.get(("delta_rule", t), float("nan"))
            for row, rate in result["tokens_per_s"].items():
                ratio = f"{mine / rate:.2f}x" if row.startswith("fla") else "(other rule)"
                out.print(f"| {row} | {t} | {rate:,.0f} | {mine:,.0f} | {ratio} |")
            out.print(f"| torch matmul GFLOP/s: {result['torch_matmul_gflops']} | {t} | | | |")

    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
