"""Data parallel training on 8 simulated CPU devices gives the single-device numbers.

The device count must be set before JAX starts, so the 8-device run happens in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, optax
    import nested as nl
    from nested import sharding
    from nested.models import MemoryLM

    devices, model_axis, shard_params = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    memory = nl.recipes.delta(d_k=4, d_v=4, persist="stream")
    backbone = nl.Level("backbone",
        memory=lambda rngs: MemoryLM(memory, vocab=17, dim=16, heads=4, layers=1, rngs=rngs),
        objective=nl.objectives.next_token, update=optax.adam(1e-2), every="step")
    program = nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))
    mesh = sharding.make_mesh(data=devices // model_axis, model=model_axis,
                              devices=jax.devices()[:devices])
    state = sharding.place(program.init(jax.random.key(0), batch_size=8), mesh,
                           shard_params=shard_params)
    train, evaluate = sharding.jit_steps(program, state, mesh, shard_params=shard_params)
    losses = []
    for i in range(4):
        x = jax.random.randint(jax.random.key(i), (8, 17), 0, 17)
        state, metrics = train(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
        losses.append(float(metrics["loss"]))
    fast = jax.tree.leaves(state.fast)[0]
    print(json.dumps({"losses": losses, "fast_shards": len(fast.sharding.device_set)}))
    """
)


def run(devices, model_axis=1, shard_params=False):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(devices), str(model_axis), str(int(shard_params))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single():
    return run(1)


@pytest.mark.parametrize(("devices", "model_axis", "shard_params"), [(8, 1, False), (8, 2, True)])
def test_n_devices_match_one_device(single, devices, model_axis, shard_params):
    multi = run(devices, model_axis, shard_params)
    assert multi["fast_shards"] == devices
    assert single["fast_shards"] == 1
    for a, b in zip(multi["losses"], single["losses"], strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (multi["losses"], single["losses"])
    assert single["losses"][-1] < single["losses"][0]
