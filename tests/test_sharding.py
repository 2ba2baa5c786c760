"""Data parallel training on 8 simulated CPU devices gives the single-device numbers, and
checkpoints move between device counts.

The device count must be set before JAX starts, so every run happens in a subprocess: with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 devices, without it for 1. Two
phases of two processes each (run side by side):

1. one device: the tiny continual run (its memory carries a fast state across sequences, so
   batch-sharded fast states are exercised);
   eight devices: bad meshes, and the same run on a ``data=4 x model=2`` mesh with sharded
   slow parameters;
2. each run's checkpoint of step 4 resumed on the other device count.

The program-level steps alone (``sharding.place`` and ``sharding.jit_steps``, no loop) on two
meshes are a slow test.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tiny_configs

from nested.run import metrics

EIGHT = "--xla_force_host_platform_device_count=8"
MESH = {"data": 4, "model": 2, "shard_params": True}

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    import jax, optax
    import tiny_configs
    import nested as nl
    from nested.run import checkpoint, config as nc, sharding, train
    from nested.nn.models import MemoryLM

    def train_run(workdir, mesh):
        fields = {f"train__mesh__{k}": v for k, v in mesh.items()}
        saved, restored = [], []  # the shardings of the states the loop checkpoints
        save, restore = checkpoint.Checkpointer.save, checkpoint.Checkpointer.restore_latest
        def restore_spy(self, like):
            out = restore(self, like)
            restored.append(None if out is None else out.step)
            return out
        def spy(self, step, state, **kwargs):
            memory = jax.tree.leaves(state.fast)[0]
            embed = max(jax.tree.leaves(state.params), key=lambda x: x.size)
            saved.append({
                "fast_devices": len(memory.sharding.device_set),
                "fast_spec": str(memory.sharding.spec),
                "param_spec": str(embed.sharding.spec),
            })
            return save(self, step, state, **kwargs)
        checkpoint.Checkpointer.save, checkpoint.Checkpointer.restore_latest = spy, restore_spy
        try:
            train.train_and_evaluate(tiny_configs.config("continual", **fields), workdir)
        finally:
            checkpoint.Checkpointer.save, checkpoint.Checkpointer.restore_latest = save, restore
        assert all(s == saved[0] for s in saved)
        return {**saved[0], "restored_step": restored[0]}

    def error(name, mesh, train_fields):
        fields = {f"train__mesh__{k}": v for k, v in mesh.items()}
        fields.update({f"train__{k}": v for k, v in train_fields.items()})
        try:
            train.make_layout(nc.build(tiny_configs.config(name, **fields)))
        except nc.ConfigError as e:
            return str(e)
        return None

    def program_losses(devices, model_axis, shard_params):
        memory = nl.recipes.delta(d_k=4, d_v=4, persist="stream")
        backbone = nl.Level("backbone",
            memory=lambda rngs: MemoryLM(memory, vocab=17, dim=16, heads=4, layers=1, rngs=rngs),
            objective=nl.objectives.next_token, update=optax.adam(1e-2), every="step")
        program = nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "backbone"}))
        mesh = sharding.make_mesh(data=devices // model_axis, model=model_axis,
                                  devices=jax.devices()[:devices])
        state = sharding.place(program.init(jax.random.key(0), batch_size=8), mesh,
                               shard_params=shard_params)
        step, _ = sharding.jit_steps(program, state, mesh, shard_params=shard_params)
        losses = []
        for i in range(4):
            x = jax.random.randint(jax.random.key(i), (8, 17), 0, 17)
            state, metrics = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
            losses.append(float(metrics["loss"]))
        fast = jax.tree.leaves(state.fast)[0]
        return {"losses": losses, "fast_shards": len(fast.sharding.device_set)}

    jobs = json.loads(sys.argv[2])
    out = {}
    for name, (kind, *args) in jobs.items():
        start = time.perf_counter()
        out[name] = {"train": train_run, "error": error, "program": program_losses}[kind](*args)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print("RESULT " + json.dumps(out))
    """
)


def start(jobs: dict, *, devices: int, env: dict) -> subprocess.Popen:
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu"}
    # The inherited flags (tests/conftest.py's) without any device count, then ours.
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith(EIGHT.split("=")[0])]
    env["XLA_FLAGS"] = " ".join(flags + ([EIGHT] if devices == 8 else []))
    command = [sys.executable, "-c", SCRIPT, str(tiny_configs.ROOT / "tests"), json.dumps(jobs)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    try:
        out, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, err[-3000:]
    result = [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(result[len("RESULT ") :]), err


def resumable_copy(workdir, target):
    """A copy of a finished run's workdir as it was right after the checkpoint of step 4."""
    shutil.copytree(workdir, target)
    shutil.rmtree(target / "checkpoints" / "8")
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    with tiny_configs.compilation_cache(tmp_path_factory) as env:
        one = start(
            {"run": ["train", str(tmp / "one"), {}]},
            devices=1,
            env=env,
        )
        eight = start(
            {
                "run": ["train", str(tmp / "eight"), MESH],
                "data_3": ["error", "continual", {"data": 3}, {}],
                "model_3": ["error", "continual", {"model": 3}, {}],
                "all_on_data": ["error", "continual", {}, {}],
                "batch_6": ["error", "mqar", {"data": 4, "model": 2}, {"batch_size": 6}],
                "eval_batch_6": ["error", "mqar", {"data": 4, "model": 2}, {"eval_batch_size": 6}],
                "fits": ["error", "mqar", {"data": 2, "model": 4}, {}],
            },
            devices=8,
            env=env,
        )
        (one, _), (eight, _) = finish(one), finish(eight)
        to_eight = resumable_copy(tmp / "one", tmp / "one_then_eight")
        to_one = resumable_copy(tmp / "eight", tmp / "eight_then_one")
        resume_on_eight = start({"run": ["train", str(to_eight), MESH]}, devices=8, env=env)
        resume_on_one = start({"run": ["train", str(to_one), {}]}, devices=1, env=env)
        resumed = {"on_eight": finish(resume_on_eight), "on_one": finish(resume_on_one)}
    return {"tmp": tmp, "one": one, "eight": eight, "resumed": resumed}


def assert_close_records(a, b):
    """The same records (steps, splits, metrics) up to float summation order."""
    timing = metrics.TIMING_KEYS
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            if key not in ("step", "split", *timing):
                np.testing.assert_allclose(x[key], y[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_training_loop_on_8_devices_matches_1_device(runs):
    tmp = runs["tmp"]
    records = metrics.read(tmp / "eight")
    assert len(records) == 8  # 4 train windows + 2 evals x 2 splits
    assert_close_records(records, metrics.read(tmp / "one"))
    # the carried fast state (B=4, H=2, ...) is split 4 ways on the batch, 2 on the heads;
    # the embedding table is split along data (shard_params); on one device nothing is split
    assert runs["eight"]["run"] == {
        "fast_devices": 8,
        "fast_spec": "P('data', 'model')",
        "param_spec": "P(None, 'data')",
        "restored_step": None,
    }
    assert runs["one"]["run"]["fast_devices"] == 1


@pytest.mark.parametrize(("resumed", "saved_on"), [("on_eight", "one"), ("on_one", "eight")])
def test_a_checkpoint_resumes_on_another_device_count(runs, resumed, saved_on):
    tmp = runs["tmp"]
    result, _ = runs["resumed"][resumed]
    assert result["run"]["restored_step"] == 4
    workdir = tmp / ("one_then_eight" if resumed == "on_eight" else "eight_then_one")
    records = metrics.read(workdir)
    saved = metrics.read(tmp / saved_on)
    # steps up to 4 are the saving run's own records; the rest were trained after the move
    assert [r for r in records if r["step"] <= 4] == [r for r in saved if r["step"] <= 4]
    assert_close_records(records, metrics.read(tmp / "one"))
    assert result["run"]["fast_devices"] == (8 if resumed == "on_eight" else 1)


@pytest.mark.slow
@pytest.mark.parametrize(("model_axis", "shard_params"), [(1, False), (2, True)])
def test_program_steps_on_n_devices_match_one_device(model_axis, shard_params):
    """``sharding.place`` and ``sharding.jit_steps`` alone (no loop); the one-device
    reference runs in the same process on the first device."""
    jobs = {"one": ["program", 1, 1, False], "eight": ["program", 8, model_axis, shard_params]}
    result, _ = finish(start(jobs, devices=8, env={}))
    single, multi = result["one"], result["eight"]
    assert multi["fast_shards"] == 8 and single["fast_shards"] == 1
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5)
    assert single["losses"][-1] < single["losses"][0]


def test_a_mesh_that_does_not_fit_names_the_key(runs):
    errors = runs["eight"]
    sizes = "['data=8 x model=1', 'data=4 x model=2', 'data=2 x model=4', 'data=1 x model=8']"
    assert errors["data_3"] == (
        f"train.mesh.data=3 x train.mesh.model=1 does not fit the 8 cpu device(s); allowed: "
        f"{sizes} (data=0: every device not on model)"
    )
    assert errors["model_3"].startswith("train.mesh.data=0 x train.mesh.model=3 does not fit")
    assert errors["batch_6"] == (
        "train.batch_size=6 is not divisible by the mesh's data axis (4 devices); use a "
        "multiple of 4 (train.mesh.data=4)"
    )
    assert errors["eval_batch_6"] == (
        "train.eval_batch_size=6 is not divisible by the mesh's data axis (4 devices); use a "
        "multiple of 4 (train.mesh.data=4)"
    )
    # the default mesh puts all 8 devices on data
    assert errors["all_on_data"] == (
        "train.batch_size=4 is not divisible by the mesh's data axis (8 devices); use a "
        "multiple of 8 (train.mesh.data=0)"
    )
    assert errors["fits"] is None
