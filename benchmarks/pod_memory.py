"""Will a config fit a pod? Compile its training step for N simulated devices, allocate nothing.

    python benchmarks/pod_memory.py --configs lm.py:transformer-1.3b lm.py:gated_deltanet-1.3b \
        --devices 64 --mesh 1 16 4 --microbatches 8 --remat full

For each config, the step is lowered with abstract arrays on the mesh ``data x fsdp x tensor``
of ``--devices`` simulated CPU devices (``--xla_force_host_platform_device_count``, set before
JAX starts) and compiled; XLA's ``memory_analysis()`` of the compiled step gives the bytes one
device holds: arguments (its shards of the parameters, optimizer state, fast states and batch),
temporaries, and outputs not aliased to the arguments. FLOPs per token are the analytic
training figure of :func:`nested.run.flops.per_token`. The CPU compiler's figures estimate an
accelerator's (its fusion, scheduling and buffer reuse differ), so leave a margin. Prints a
markdown table and writes it into this benchmark's section of benchmarks/README.md
(``--no-write``: printed only). A quick check (seconds): ``--configs lm.py:transformer-tiny
--devices 8 --mesh 1 4 2 --microbatches 1 --no-write``. Hope's 1.3B step compiles in tens of
minutes on two cores (its chunk scans unrolled over 24 layers); the others in about a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

GIB = 2**30


def compiled_memory(config, devices=None) -> dict:
    """``{"parameters", "devices", "mesh", "arguments", "temporaries", "bytes", "seconds"}`` of
    the training step of ``config`` (a ConfigDict) compiled for its ``train.mesh`` over
    ``devices`` (default: all), per device, from abstract arrays only."""
    import jax
    import jax.numpy as jnp

    from nested.run import config as nc
    from nested.run import pieces

    start = time.perf_counter()
    exp = nc.build(config)
    layout = pieces.make_layout(exp, devices=devices)
    abstract = jax.eval_shape(pieces.init_fn(exp), jax.random.key(0))
    placed = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, layout.state
    )
    shape = (1, config.train.batch_size, config.task.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    step = pieces.make_train_fn(exp.program, layout).lower(placed, batch).compile()
    analysis = step.memory_analysis()
    used = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
    used += analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return {
        "parameters": sum(x.size for x in jax.tree.leaves(abstract.params)),
        "devices": layout.mesh.size,
        "mesh": layout.mesh,
        "arguments": analysis.argument_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "bytes": used,
        "seconds": time.perf_counter() - start,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["lm.py:transformer-1.3b"])
    parser.add_argument("--devices", type=int, default=64, help="simulated CPU devices")
    parser.add_argument(
        "--mesh", nargs=3, type=int, default=[1, 16, 4], help="data fsdp tensor (-1: the rest)"
    )
    parser.add_argument("--microbatches", type=int, default=8, help="train.microbatches")
    parser.add_argument("--remat", default="full", help="model.remat")
    parser.add_argument("--device_gib", type=float, default=80.0, help="one device's memory")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    import report

    from nested.run import config as nc
    from nested.run import flops, sharding

    out = report.Report("pod_memory")
    out.print(
        f"Per device (a device holds {args.device_gib:g} GiB): XLA:CPU's memory_analysis() of the "
        f"training step compiled for {args.devices} simulated devices ({args.microbatches} "
        f"microbatches, remat {args.remat}); FLOPs/token: analytic training FLOPs "
        "(nested.run.flops)."
    )
    out.print()
    head = ["config", "parameters", "mesh (data, fsdp, tensor)", "batch x seq", "arguments GiB"]
    head += ["temporaries GiB", "per device GiB", "fits", "GFLOPs/token", "compile s"]
    out.print("| " + " | ".join(head) + " |")
    out.print("|" + "---|" * len(head))
    data, fsdp, tensor = args.mesh
    for spec in args.configs:
        config = nc.load(f"configs/{spec}")
        config.train.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
        config.train.microbatches = args.microbatches
        config.model.remat = args.remat
        m = compiled_memory(config)
        per_device = m["bytes"] / GIB
        cells = [
            spec,
            f"{m['parameters'] / 1e6:,.0f}M",
            sharding.describe(m["mesh"]),
            f"{config.train.batch_size} x {config.task.seq_len}",
            f"{m['arguments'] / GIB:.2f}",
            f"{m['temporaries'] / GIB:.1f}",
            f"{per_device:.1f}",
            "yes" if per_device <= args.device_gib else "**no**",
            f"{flops.per_token(config)['train'] / 1e9:.2f}",
            f"{m['seconds']:.0f}",
        ]
        out.print("| " + " | ".join(cells) + " |")
    if not args.no_write:
        out.write()


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={arguments.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(arguments)
