"""Scaling of one training step with the sequence length, and over devices and processes.

    .venv/bin/python benchmarks/scaling.py [--lengths 1024 4096 16384] [--rules delta gdn2] \
        [--batch 1] [--dim 256] [--heads 4]
    .venv/bin/python benchmarks/scaling.py --lengths 64 --rules delta --runs 1 --no-devices

For each rule and length T: the compiled temporary memory of one jitted training step
(``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``), its ratio to the
smallest T's (linear growth means the ratio tracks T), and tokens/s (median of runs after a
warm-up). Then the losses and step time of one training run on 1 device, on 2 and 8 simulated
CPU devices of one process (``--xla_force_host_platform_device_count``), and on the same
devices split over 2 processes (``python -m nested.launch``, gloo collectives over loopback),
measured in the same job. Prints markdown tables and writes them into this benchmark's section of
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
import json, sys, time
import jax, numpy as np, optax
import nested as nl
from nested.run import distributed, sharding
from nested.nn.models import MemoryLM
devices, flags = int(sys.argv[1]), dict(a[2:].split("=") for a in sys.argv[2:])
if flags:  # started by nested.launch: one of several processes
    distributed.initialize(distributed.Settings(flags["coordinator_address"],
        int(flags["num_processes"]), int(flags["process_id"])))
memory = nl.recipes.delta(d_k=16, d_v=16)
backbone = nl.Level("backbone",
    memory=lambda rngs: MemoryLM(memory, vocab=64, dim=64, heads=4, layers=2, rngs=rngs),
    objective=nl.objectives.next_token, update=optax.adam(3e-3), every="step")
program = nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))
mesh = sharding.make_mesh(data=devices, devices=jax.devices()[:devices])
layout = sharding.Layout.of(jax.eval_shape(program.init, jax.random.key(0)), mesh)
state = jax.jit(program.init, out_shardings=layout.state)(jax.random.key(0))
train, _ = sharding.jit_steps(program, state, mesh)
losses, seconds, rows = [], [], layout.rows(8)
for i in range(25):
    x = np.random.default_rng(i).integers(0, 64, (8, 129)).astype(np.int32)
    batch = layout.put({"inputs": x[rows, :-1], "targets": x[rows, 1:]}, 8)
    began = time.perf_counter()
    state, metrics = train(state, batch)
    losses.append(float(metrics["loss"]))
    seconds.append(time.perf_counter() - began)
if distributed.is_primary():
    print(json.dumps({"losses": losses[:20], "ms": 1e3 * float(np.median(seconds[5:]))}))
distributed.finish()
"""


def device_run(devices: int, processes: int = 1) -> dict:
    """Losses of 20 training steps and the median ms a step (after 5) on ``devices`` simulated
    CPU devices, spread over ``processes`` processes (``nested.launch``, gloo collectives)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    line = [sys.executable, "-c", DEVICE_SCRIPT, str(devices)]
    if processes > 1:
        per_process = f"--devices_per_process={devices // processes}"
        launcher = ["-m", "nested.launch", f"--num_processes={processes}", per_process, "--"]
        line = [sys.executable, *launcher, *line]
    else:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(line, env=env, capture_output=True, text=True, check=True)
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
        layouts = {
            "1 device": (1, 1),
            "2 devices": (2, 1),
            "2 processes x 1 device": (2, 2),
            "8 devices": (8, 1),
            "2 processes x 4 devices": (8, 2),
        }
        runs = {name: device_run(*layout) for name, layout in layouts.items()}
        one = runs["1 device"]["losses"]
        # Step 1 differs by summation order alone; later steps add Adam's amplification of it.
        out.print(
            "\nA 2-layer LM (dim 64, delta memory), batch 8 x 128, 20 Adam steps, simulated "
            "CPU devices; ms a step is the median after 5 (the processes share this machine's "
            "cores)\n"
        )
        out.print(
            "| layout | loss, step 1 | loss, step 20 | abs difference vs 1 device: step 1 "
            "| max over 20 steps | ms a step |"
        )
        out.print("|---|---|---|---|---|---|")
        for name, run in runs.items():
            diffs = [abs(a - b) for a, b in zip(one, run["losses"], strict=True)]
            out.print(
                f"| {name} | {run['losses'][0]:.6f} | {run['losses'][-1]:.6f} | "
                f"{diffs[0]:.1e} | {max(diffs):.1e} | {run['ms']:.1f} |"
            )

    if not args.no_write:
        out.write()


if __name__ == "__main__":
    main()
