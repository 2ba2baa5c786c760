"""Forward+backward throughput of the Type II ops (TTT-MLP, Titans, ATLAS) on this machine.

    .venv/bin/python benchmarks/neural_throughput.py [--T 1024] [--runs 5] [--peers] [--rounds 3]
    .venv/bin/python benchmarks/neural_throughput.py --T 64 --runs 1 --only "TTT-MLP C=16"

Prints one markdown table (two with ``--peers``) and writes them into this benchmark's section
of benchmarks/README.md (``--no-write``: printed only). Shapes: B=4, H=4, d_k=d_v=64, depth-2
memory 64 -> 256 -> 64 per head, float32. tokens/s = B*T / median seconds after a warm-up call,
for the jitted forward (loss = sum of outputs) and forward+backward (gradient w.r.t. q, k, v,
every gate and the initial state). ``bwd/fwd`` is the cost of forward+backward over the forward
alone, the median of ratios of the two timed back to back (the calls alternate); ``temp MB``
the compiled forward+backward's temporary memory. ``C=1`` rows are the per-token (online)
recurrence, every token's gradient at the state before it (a scan over tokens, blocks of 16,
with the hand-written backward of ``nested.ops.online``).
The 2048^2 float32 matmul rate, measured in the same run, puts the rows in proportion.

ATLAS rows use window 4 and degree-2 polynomial key features (memory input 128). With Muon
(5 Newton-Schulz steps) every token orthogonalises its two momentum matrices (256 x 128 and
64 x 256), about 130 MFLOP per token and head, so those rows run on a shorter sequence (--muon-T).

--rounds R repeats every measurement R times and reports medians; against the peers each
round's ratio is taken from figures measured minutes apart, and the table shows the median
ratio with its range over the rounds (a shared machine's throughput drifts between runs).

--peers runs ../shared/peers/bench_peers.py (titans-pytorch NeuralMemory, depth-2 MLP memory,
chunk-start reads) with the interpreter ``bash ../shared/peers/setup.sh`` prints, and adds
its rows with our ratio against them. Compare only within one run: the machine is shared.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import report
import timing

from nested import ops

B, H, D, HIDDEN = 4, 4, 64, 256


def inputs(t, d_k, chunk):
    """The sequence and gates; step sizes in (0.01, 0.1) / (4 chunk): a chunk's steps add up at
    its start state, and with (0.01, 0.1) the chunked Titans and ATLAS memories (and ATLAS per
    token, whose momentum sums its window's gradients) diverge to NaN, which times nothing."""
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    gate = lambda lo, hi: jnp.asarray(rng.uniform(lo, hi, (B, t, H)), jnp.float32)
    k = normal(B, t, H, d_k)
    return {
        "q": normal(B, t, H, d_k),
        "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        "v": normal(B, t, H, D),
        "lr": gate(0.01, 0.1) / (4 * chunk),
        "momentum": gate(0.8, 0.95),
        "decay": gate(0.0, 0.05),
        "gates": gate(0.5, 1.0),
    }


def memory(d_in):
    return ops.init_mlp_memory(
        jax.random.key(0), batch=B, heads=H, d_in=d_in, d_out=D, hidden=HIDDEN
    )


def case(op, chunk, t, **config):
    """(loss(x, state), x, state) for one op; x holds the sequence and its gates."""
    if op == "ttt_mlp":
        x = {n: y for n, y in inputs(t, D, chunk).items() if n in ("q", "k", "v", "lr")}

        def loss(x, state):
            return ops.ttt_mlp(**x, params=state, chunk_size=chunk)[0].sum()

        return loss, x, memory(D)
    if op == "titans":
        x = {n: y for n, y in inputs(t, D, chunk).items() if n != "gates"}

        def loss(x, state):
            return ops.titans(**x, state=state, chunk_size=chunk, **config)[0].sum()

        return loss, x, ops.titans_state(memory(D))
    x = inputs(t, D, chunk)
    window = 4

    def loss(x, state):
        o, _ = ops.atlas(
            **x, state=state, window=window, chunk_size=chunk,
            feature_map=ops.polynomial_features, **config,
        )  # fmt: skip
        return o.sum()

    return loss, x, ops.atlas_state(memory(2 * D), window=window, d_k=D)


def measure(op, chunk, t, runs, **config):
    loss, x, state = case(op, chunk, t, **config)
    fwd = jax.jit(loss)
    both = jax.jit(jax.grad(loss, argnums=(0, 1)))
    grads = both(x, state)
    if not all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves((fwd(x, state), grads))):
        raise SystemExit(f"{op} C={chunk}: non-finite outputs or gradients; timing them is void")
    temp = both.lower(x, state).compile().memory_analysis().temp_size_in_bytes
    turns = timing.paired_seconds((fwd, both), (x, state), runs)
    t_fwd, t_both = (float(np.median(column)) for column in zip(*turns, strict=True))
    ratio = float(np.median([b / f for f, b in turns]))  # each pair timed back to back
    return {"fwd": B * t / t_fwd, "fwd_bwd": B * t / t_both, "ratio": ratio, "temp": temp}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--muon-T", type=int, default=32, help="sequence length of Muon rows")
    parser.add_argument("--peers", action="store_true", help="also run titans-pytorch")
    parser.add_argument("--rounds", type=int, default=1, help="measure everything this often")
    parser.add_argument("--only", default="", help="run only rows whose label contains this")
    report.add_flag(parser, "neural_throughput")
    args = parser.parse_args()
    t = args.T
    rows = [  # label, op, chunk, T, config
        *[(f"TTT-MLP C={c}", "ttt_mlp", c, t, {}) for c in (16, 64, 1)],
        *[(f"Titans C={c}", "titans", c, t, {}) for c in (16, 64, 1)],
        *[
            (f"Titans chunk-start read C={c}", "titans", c, t, {"read": "chunk_start"})
            for c in (16, 64, 1)
        ],
        *[(f"ATLAS C={c}", "atlas", c, t, {}) for c in (16, 64, 1)],
        *[(f"ATLAS+Muon(5) C={c}", "atlas", c, args.muon_T, {"muon_steps": 5}) for c in (16, 1)],
    ]
    rows = [row for row in rows if args.only in row[0]]
    out = report.Report(args.section)
    rounds = []  # per round: label -> measure(), and the peers' tokens/s
    for r in range(args.rounds):
        results = {}
        for label, op, chunk, length, config in rows:
            start = time.perf_counter()
            results[label] = measure(op, chunk, length, args.runs, **config)
            print(f"round {r + 1} {label}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        rounds.append((results, timing.peer_rows(t, args.runs) if args.peers else None))
    median = lambda values: float(np.median(values))
    stat = lambda label, key: median([res[label][key] for res, _ in rounds])

    settings = f"B={B}, H={H}, d={D}, memory {D}->{HIDDEN}->{D}, float32"
    if args.peers:
        settings += f"; torch 2048^2 matmul {rounds[-1][1]['torch_matmul_gflops']:.0f} GFLOP/s"
    out.print(settings)
    if args.rounds > 1:
        out.print(
            f"Medians over {args.rounds} rounds (each round measures every row, then the peers)."
        )
    out.print()
    out.print("| row | T | fwd tok/s | fwd+bwd tok/s | bwd/fwd | temp MB | vs per-token |")
    out.print("| --- | --: | --: | --: | --: | --: | --: |")
    for label, _, _, length, _ in rows:
        base = label.rsplit("C=", 1)[0] + "C=1"
        speedup = "-"
        if base in rounds[0][0]:
            speedup = f"{stat(label, 'fwd_bwd') / stat(base, 'fwd_bwd'):.1f}x"
        out.print(
            f"| {label} | {length} | {stat(label, 'fwd'):.0f} | {stat(label, 'fwd_bwd'):.0f} | "
            f"{stat(label, 'ratio'):.2f} | {stat(label, 'temp') / 2**20:.0f} | {speedup} |"
        )
    if args.peers:
        # Ratios are taken round by round (ours and theirs minutes apart), then summarised.
        out.print(
            "\n| titans-pytorch (fwd+bwd) | tok/s | ours after-write | ratio | ours chunk-start "
            "| ratio |"
        )
        out.print("| --- | --: | --: | --: | --: | --: |")
        for c in (16, 64):
            theirs = [p["tokens_per_s"][f"titans_depth2_C{c}"] for _, p in rounds]
            cells = []
            for label in (f"Titans C={c}", f"Titans chunk-start read C={c}"):
                if label not in rounds[0][0]:
                    cells += ["-", "-"]
                    continue
                ours = [res[label]["fwd_bwd"] for res, _ in rounds]
                ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
                spread = f" ({min(ratios):.1f}-{max(ratios):.1f})" if len(ratios) > 1 else ""
                cells += [f"{stat(label, 'fwd_bwd'):.0f}", f"{median(ratios):.1f}x{spread}"]
            out.print(f"| C={c} | {median(theirs):.0f} | " + " | ".join(cells) + " |")

    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
