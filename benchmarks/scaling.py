"""Scaling of one training step with the sequence length, and 1 vs 8 devices.

    python benchmarks/scaling.py [--lengths 1024,4096,16384] [--rules delta,gated_delta] \
        [--batch 1] [--dim 256] [--heads 4]

For each rule and length T: the compiled temporary memory of one jitted training step
(``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``), its ratio to the
smallest T's (linear growth means the ratio tracks T), and tokens/s (median of runs after a
warm-up). Then the loss difference between a training run on 1 device and on 8 simulated CPU
devices (a subprocess with ``--xla_force_host_platform_device_count=8``), measured in the same
job. Prints markdown tables.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import jax
import optax
from absl import app, flags

import nested as nl
from nested.nn.models import MemoryLM

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1024", "4096", "16384"], "sequence lengths T")
flags.DEFINE_list("rules", ["delta", "gated_delta", "gdn2"], "rules (nested.recipes.RULES)")
flags.DEFINE_integer("batch", 1, "sequences per step")
flags.DEFINE_integer("dim", 256, "model width")
flags.DEFINE_integer("heads", 4, "memory heads (d_k = d_v = dim / heads)")
flags.DEFINE_integer("runs", 3, "timed runs per measurement")
flags.DEFINE_boolean("devices", True, "also compare 1 vs 8 simulated devices")


def program(rule: str, dim: int, heads: int, vocab: int = 256) -> nl.Program:
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
    return nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))


def measure(rule: str, T: int) -> dict:
    prog = program(rule, FLAGS.dim, FLAGS.heads)
    state = prog.init(jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (FLAGS.batch, T + 1), 0, 256)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    step = jax.jit(prog.train_step)
    compiled = step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(state, batch))
    times = []
    for _ in range(FLAGS.runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - start)
    return {"temp": temp, "tokens_per_s": FLAGS.batch * T / statistics.median(times)}


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


def main(argv):
    del argv
    lengths = [int(t) for t in FLAGS.lengths]
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].platform}, batch {FLAGS.batch}, "
        f"dim {FLAGS.dim}, heads {FLAGS.heads}, 2-layer LM, one training step\n"
    )
    print("| rule | T | temp MiB | temp / temp(T0) | T / T0 | tokens/s |")
    print("|---|---|---|---|---|---|")
    for rule in FLAGS.rules:
        base = None
        for T in lengths:
            m = measure(rule, T)
            base = base or m["temp"]
            print(
                f"| {rule} | {T} | {m['temp'] / 2**20:.1f} | {m['temp'] / base:.2f} | "
                f"{T / lengths[0]:.0f} | {m['tokens_per_s']:,.0f} |",
                flush=True,
            )
    if FLAGS.devices:
        one, eight = device_losses(1), device_losses(8)
        diffs = [abs(a - b) for a, b in zip(one, eight, strict=True)]
        # Step 1 differs by summation order alone; later steps add Adam's amplification of it.
        print(
            "\n| devices | loss, step 1 | loss, step 20 | abs difference vs 1 device: step 1 "
            "| max over 20 steps |"
        )
        print("|---|---|---|---|---|")
        print(f"| 1 | {one[0]:.6f} | {one[-1]:.6f} | 0 | 0 |")
        print(f"| 8 | {eight[0]:.6f} | {eight[-1]:.6f} | {diffs[0]:.1e} | {max(diffs):.1e} |")


if __name__ == "__main__":
    app.run(main)
