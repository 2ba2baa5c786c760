"""Will a config fit a pod? Compile its training step for N simulated devices, allocate nothing.

    python benchmarks/pod_memory.py --config=configs/lm.py:hope-1.3b --devices=64 \
        --mesh=1,16,4 --microbatches=4 --remat=full

The step is lowered with abstract arrays on the mesh ``data x fsdp x tensor`` of ``--devices``
simulated CPU devices (``--xla_force_host_platform_device_count``, set before JAX starts) and
compiled; XLA's ``memory_analysis()`` of the compiled step gives the bytes one device holds:
arguments (its shards of the parameters, optimizer state, fast states and batch), temporaries,
and outputs not aliased to the arguments. The CPU compiler's figures estimate an accelerator's:
its fusion and scheduling differ, so leave a margin. A compile of a 1.3B nested model for 64
devices takes tens of minutes on two cores.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/lm.py:hope-1.3b", "Config file[:variant].")
_DEVICES = flags.DEFINE_integer("devices", 64, "Simulated devices.")
_MESH = flags.DEFINE_list("mesh", ["1", "16", "4"], "data,fsdp,tensor sizes (-1: the rest).")
_MICRO = flags.DEFINE_integer("microbatches", 4, "train.microbatches.")
_REMAT = flags.DEFINE_string("remat", "full", "model.remat.")
_DEVICE_GIB = flags.DEFINE_float("device_gib", 80.0, "Memory of one device, GiB.")


def compiled_memory(config, devices=None) -> dict:
    """``{"parameters", "devices", "arguments", "temporaries", "bytes", "seconds"}`` of the
    training step of ``config`` (a ConfigDict) compiled for its ``train.mesh`` over
    ``devices`` (default: all), per device, from abstract arrays only."""
    import jax
    import jax.numpy as jnp

    from nested.run import config as nc
    from nested.run import train

    start = time.perf_counter()
    exp = nc.build(config)
    layout = train.make_layout(exp, devices=devices)
    abstract = jax.eval_shape(train._init_fn(exp), jax.random.key(0))
    placed = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, layout.state
    )
    shape = (1, config.train.batch_size, config.task.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    step = train.make_train_fn(exp.program, layout).lower(placed, batch).compile()
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


def main(argv):
    del argv
    from nested.run import config as nc
    from nested.run import sharding

    config = nc.load(_CONFIG.value)
    data, fsdp, tensor = (int(size) for size in _MESH.value)
    config.train.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    config.train.microbatches = _MICRO.value
    config.model.remat = _REMAT.value
    out = compiled_memory(config)
    gib = 2**30
    print(f"{_CONFIG.value} on {sharding.describe(out['mesh'])}, {_MICRO.value} microbatches,")
    count = f"{out['parameters'] / 1e6:,.1f}M"
    print(f"remat {_REMAT.value}: {count} parameters; per device:")
    args, temps = out["arguments"] / gib, out["temporaries"] / gib
    print(f"  arguments {args:.2f} GiB, temporaries {temps:.2f} GiB")
    fits = "fits" if out["bytes"] <= _DEVICE_GIB.value * gib else "does NOT fit"
    print(f"  in all {out['bytes'] / gib:.2f} GiB: {fits} a {_DEVICE_GIB.value:g} GiB device")
    print(f"compiled in {out['seconds']:.0f} s on {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    count = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), "64")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    app.run(main)
