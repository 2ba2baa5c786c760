"""Scaling of one training step with the sequence length, and 1 vs 8 devices.

    .venv/bin/python benchmarks/scaling.py [--lengths 1024 4096 16384] [--rules delta gdn2] \
        [--batch 1] [--dim 256] [--heads 4]
    .venv/bin/python benchmarks/scaling.py --lengths 64 --rules delta --runs 1 --no-devices

For each rule and length T: the compiled temporary memory of one jitted training step
(``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``), its ratio to the
smallest T's (linear growth means the ratio tracks T), and tokens/s (median of runs after a
warm-up). Then the loss difference between a training run on 1 device and on 8 simulated CPU
devices (a subprocess with ``--xla_force_host_platform_device_count=8``), measured in the same
job. Prints markdown tables and writes them into this benchmark's section of
benchmarks/README.md (``--no-write``: printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import optax
import report
import timing

import nested as nl
from nested.nn.models import MemoryLM


def program(rule: str, dim: int, heads: int, dtype=None, vocab: int = 256) -> nl.Program:
    d = dim // heads
    memory = nl.recipes.RULES[rule](d_k=d, d_v=d)
    backbone = nl.Level(
        "backbone",
        memory=lambda rngs: MemoryLM(
            memory, vocab=vocab, dim=dim, heads=heads, layers=2, rngs=rngs
        ),
        objective=nl.objectives.next_token,
        update=optax.adamw(1e-3),
        every="step",
    )
    system = nl.NestedSystem([backbone, memory], owners={"memory": "backbone"})
    return nl.compile(system, compute_dtype=dtype)


def measure(rule: str, T: int, args: argparse.Namespace) -> dict:
    prog = program(rule, args.dim, args.heads, None if args.dtype == "float32" else args.dtype)
    state = prog.init(jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (args.batch, T + 1), 0, 256)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    step = jax.jit(prog.train_step)
    compiled = step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    seconds = timing.median_seconds(compiled, (state, batch), args.runs)
    return {"temp": temp, "tokens_per_s": args.batch * T / seconds}


DEVICE_SCRIPT = """
import json, sys
import jax, optax
import nested as nl
from nested.run import sharding
from nested.nn.models import MemoryLM
devices = int(sys.argv[1])
memory = nl.recipes.delta(d_k=16, d_v=16)
backbone = nl.Level("backbone",
    memory=lambda rngs: MemoryLM(memory, vocab=64, dim=64, heads=4, layers=2, rngs=rngs),
    objective=nl.objectives.next_token, update=optax.adam(3e-3), every="step")
program = nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))
mesh = sharding.make_mesh(data=devices, devices=jax.devices()[:devices])
state = sharding.place(program.init(jax.random.key(0)), mesh)
train, _ = sharding.jit_steps(program, state, mesh)
losses = []
for i in range(20):
    x = jax.random.randint(jax.random.key(i), (8, 129), 0, 64)
    state, metrics = train(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
    losses.append(float(metrics["loss"]))
print(json.dumps(losses))
"""


def device_losses(devices: int) -> list[float]:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", DEVICE_SCRIPT, str(devices)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument(
        "--rules",
        nargs="+",
        default=["delta", "gated_delta", "gdn2"],
        choices=sorted(nl.recipes.RULES),
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="memory heads (d_k = dim / heads)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per measurement")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype (parameters and fast states stay float32)",
    )
    parser.add_argument(
        "--no-devices", action="store_true", help="skip the 1 vs 8 simulated devices comparison"
    )
    report.add_flag(parser, "scaling")
    args = parser.parse_args()

    out = report.Report(args.section)
    out.print(
        f"batch {args.batch}, dim {args.dim}, heads {args.heads}, 2-layer LM, one training step, "
        f"{args.dtype} compute\n"
    )
    out.print("| rule | T | temp MiB | temp / temp(T0) | T / T0 | tokens/s |")
    out.print("|---|---|---|---|---|---|")
    for rule in args.rules:
        base = None
        for T in args.lengths:
            m = measure(rule, T, args)
            base = base or m["temp"]
            out.print(
                f"| {rule} | {T} | {m['temp'] / 2**20:.1f} | {m['temp'] / base:.2f} | "
                f"{T / args.lengths[0]:.0f} | {m['tokens_per_s']:,.0f} |"
            )
    if not args.no_devices:
        one, eight = device_losses(1), device_losses(8)
        diffs = [abs(a - b) for a, b in zip(one, eight, strict=True)]
        # Step 1 differs by summation order alone; later steps add Adam's amplification of it.
        out.print(
            "\n| devices | loss, step 1 | loss, step 20 | abs difference vs 1 device: step 1 "
            "| max over 20 steps |"
        )
        out.print("|---|---|---|---|---|")
        out.print(f"| 1 | {one[0]:.6f} | {one[-1]:.6f} | 0 | 0 |")
        out.print(f"| 8 | {eight[0]:.6f} | {eight[-1]:.6f} | {diffs[0]:.1e} | {max(diffs):.1e} |")

    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
