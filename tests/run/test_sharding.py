"""Training on 8 simulated CPU devices, on meshes of ``data``, ``fsdp`` and ``tensor``, gives
the single-device numbers; checkpoints move between meshes; FSDP and tensor parallelism divide
the bytes each device holds.

The device count must be set before JAX starts, so every run happens in a subprocess: with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 devices, without it for 1. Two
phases of processes run side by side:

1. one device: the tiny continual run (its memory carries a fast state across sequences, so
   batch-sharded fast states are exercised);
   eight devices: bad meshes, the bytes per device, and the same run on
   ``data=2 x fsdp=2 x tensor=2``;
2. the checkpoint of step 4 of the 8-device run resumed on one device and on ``fsdp=8``, and
   the one-device run's on ``data=2 x fsdp=2 x tensor=2``.

Every test here runs with -m slow (``.ci/run`` runs them after the default suite): the
8-device processes take about a minute, the language models' steps (tiny Hope and Titans-MAC,
10 steps on three meshes; tiny Hope and Transformer++ on the padded bytes vocabulary, on two)
and the 1.3B Transformer++ step compiled for 64 devices longer (``benchmarks/pod_memory.py``,
whose compile the bytes test also uses, sizes any config on a pod).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import tiny_configs

from nested.run import metrics

pytestmark = pytest.mark.slow

EIGHT = "--xla_force_host_platform_device_count=8"
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
FSDP = {"data": 1, "fsdp": 8}
BATCH = {"batch_size": 8, "eval_batch_size": 8}  # rows that fsdp=8 divides

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from helpers import tiny_configs
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from nested.nn.models import MLPBlock
    from nested.run import checkpoint, config as nc, partitioning, sharding, train, pieces
    sys.path.insert(0, str(tiny_configs.ROOT / "benchmarks"))
    import pod_memory

    def fields_of(mesh, train_fields):
        fields = {f"train__mesh__{k}": v for k, v in mesh.items()}
        return {**fields, **{f"train__{k}": v for k, v in train_fields.items()}}

    def train_run(workdir, mesh):
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
            config = tiny_configs.config("continual", **fields_of(mesh, BATCH))
            train.train_and_evaluate(config, workdir)
        finally:
            checkpoint.Checkpointer.save, checkpoint.Checkpointer.restore_latest = save, restore
        assert all(s == saved[0] for s in saved)
        return {**saved[0], "restored_step": restored[0]}

    def error(name, mesh, train_fields):
        try:
            pieces.make_layout(nc.build(tiny_configs.config(name, **fields_of(mesh, train_fields))))
        except nc.ConfigError as e:
            return str(e)
        return None

    def lm(variant, mesh, microbatches=1, more=None):
        cfg = nc.load(str(tiny_configs.ROOT / "configs" / "lm.py") + ":" + variant)
        fields = {"task.vocab_size": 256, "task.seq_len": 64, "train.batch_size": 8,
                  "train.eval_batch_size": 8, "train.microbatches": microbatches}
        fields.update({f"train.mesh.{k}": v for k, v in mesh.items()})
        fields.update(more or {})
        return nc.build(tiny_configs.override(cfg, fields))

    def lm_losses(variant, mesh, microbatches=1, more=None, steps=10):
        exp = lm(variant, mesh, microbatches, more)
        layout = pieces.make_layout(exp, devices=jax.devices()[: 1 if not mesh else None])
        state = pieces.init_state(exp, layout)
        x = np.random.default_rng(0).integers(0, 256, (steps, 8, 65))
        batches = {"inputs": x[..., :-1], "targets": x[..., 1:], "mask": np.ones((steps, 8, 64))}
        batches = {k: jnp.asarray(v, jnp.float32 if k == "mask" else jnp.int32)
                   for k, v in batches.items()}
        _, metrics = pieces.make_train_fn(exp.program, layout)(state, batches)
        return [float(v) for v in metrics["loss"]]

    def state_bytes(variant, mesh):
        # parameters and optimizer state held per device: from the shards' shapes, and the
        # compiled step's arguments (benchmarks/pod_memory.py, memory_analysis)
        exp = lm(variant, mesh)
        devices = jax.devices()[: 1 if not mesh else None]
        layout = pieces.make_layout(exp, devices=devices)
        abstract = jax.eval_shape(pieces.init_fn(exp), jax.random.key(0))
        learned = lambda s: (s.params, s.opt_state)
        shards = zip(jax.tree.leaves(learned(abstract)), jax.tree.leaves(learned(layout.state)))
        held = sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in shards)
        compiled = pod_memory.compiled_memory(exp.config, devices)
        return {"shards": held, "arguments": compiled["arguments"]}

    def mlp_temp(tensor):
        # the temporaries of an MLP block's forward and backward pass, per device
        mesh = sharding.make_mesh(data=1, tensor=tensor, devices=jax.devices()[:tensor])
        graph, params = nnx.split(MLPBlock(64, 1024, rngs=nnx.Rngs(0)))
        specs = partitioning.parameter_specs({"mlp": params}, sharding.RULE_DEFAULTS,
                                             dict(mesh.shape))["mlp"]
        shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
        loss = lambda params, x: jnp.sum(nnx.merge(graph, params)(x) ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)),
                       in_shardings=(shard, NamedSharding(mesh, P())))
        placed = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                              params, shard)
        x = jax.ShapeDtypeStruct((8, 128, 64), jnp.float32)
        return grad.lower(placed, x).compile().memory_analysis().temp_size_in_bytes

    def pod(variant, mesh, microbatches):
        # a paper-size step compiled for every device of the process, nothing allocated
        config = nc.load(f"configs/lm.py:{variant}")
        config.train.mesh.update(**mesh)
        config.train.microbatches, config.model.remat = microbatches, "full"
        compiled = pod_memory.compiled_memory(config)
        return {k: compiled[k] for k in ("parameters", "devices", "arguments", "bytes")}

    def error_lm(variant, mesh, more):
        try:
            pieces.make_layout(lm(variant, mesh, more=more))
        except nc.ConfigError as e:
            return str(e)
        return None

    KINDS = {"train": train_run, "error": error, "lm": lm_losses, "bytes": state_bytes,
             "error_lm": error_lm,
             "mlp_temp": mlp_temp, "pod": pod}
    BATCH = json.loads(sys.argv[2])
    jobs = json.loads(sys.argv[1])
    out = {}
    for name, (kind, *args) in jobs.items():
        start = time.perf_counter()
        out[name] = KINDS[kind](*args)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print("RESULT " + json.dumps(out))
    """
)


def start(jobs: dict, *, devices: int, env: dict) -> subprocess.Popen:
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu"}
    # The inherited flags (tests/conftest.py's) without any device count, then ours.
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith(EIGHT.split("=")[0])]
    count = [f"{EIGHT.split('=')[0]}={devices}"] if devices > 1 else []
    env["XLA_FLAGS"] = " ".join(flags + count)
    command = [sys.executable, "-c", SCRIPT, json.dumps(jobs), json.dumps(BATCH)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    try:
        out, err = process.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, err[-3000:]
    result = [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(result[len("RESULT ") :]), err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compilation_cache):
    tmp = tmp_path_factory.mktemp("sharding")
    env = compilation_cache
    one = start({"run": ["train", str(tmp / "one"), {}]}, devices=1, env=env)
    eight = start(
        {
            "run": ["train", str(tmp / "eight"), MESH],
            "data_3": ["error", "continual", {"data": 3}, {}],
            "tensor_3": ["error", "continual", {"tensor": 3}, {}],
            "all_on_data": ["error", "continual", {}, {}],
            "batch_6": ["error", "mqar", {"data": 4, "tensor": 2}, {"batch_size": 6}],
            "eval_batch_6": ["error", "mqar", {"data": 4, "tensor": 2}, {"eval_batch_size": 6}],
            "microbatch_2": ["error", "mqar", MESH, {"batch_size": 8, "microbatches": 4}],
            "heads_8": ["error", "mqar", {"data": 1, "tensor": 8}, {}],
            "fits": ["error", "mqar", {"data": 4, "tensor": 2}, {}],
            "bytes_one": ["bytes", "titans-tiny", {}],
            "bytes_fsdp": ["bytes", "titans-tiny", FSDP],
            "mlp_one": ["mlp_temp", 1],
            "mlp_tensor": ["mlp_temp", 2],
        },
        devices=8,
        env=env,
    )
    (one, _), (eight, _) = finish(one), finish(eight)
    moves = {  # the saving run, the mesh (None: one device) it resumes on
        "eight_on_one": ("eight", None),
        "eight_on_fsdp": ("eight", FSDP),
        "one_on_eight": ("one", MESH),
    }
    started = {}
    for name, (saved_by, mesh) in moves.items():
        workdir = tiny_configs.resumable_copy(tmp / saved_by, tmp / name)
        job = {"run": ["train", str(workdir), mesh or {}]}
        started[name] = start(job, devices=8 if mesh else 1, env=env)
    resumed = {name: finish(process) for name, process in started.items()}
    return {"tmp": tmp, "one": one, "eight": eight, "resumed": resumed, "moves": moves}


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
    # the carried fast state (B=8, H=2, ...) is split 4 ways on the batch (data x fsdp) and 2
    # on the heads; the largest parameter (the output head: embed, vocab) along fsdp and tensor
    assert runs["eight"]["run"] == {
        "fast_devices": 8,
        "fast_spec": "P(('data', 'fsdp'), 'tensor')",
        "param_spec": "P('fsdp', 'tensor')",
        "restored_step": None,
    }
    assert runs["one"]["run"]["fast_devices"] == 1


@pytest.mark.parametrize("move", ["eight_on_one", "eight_on_fsdp", "one_on_eight"])
def test_a_checkpoint_resumes_on_another_mesh(runs, move):
    tmp = runs["tmp"]
    result, _ = runs["resumed"][move]
    saved_by, mesh = runs["moves"][move]
    assert result["run"]["restored_step"] == 4
    records = metrics.read(tmp / move)
    saved = metrics.read(tmp / saved_by)
    # steps up to 4 are the saving run's own records; the rest were trained after the move
    assert [r for r in records if r["step"] <= 4] == [r for r in saved if r["step"] <= 4]
    assert_close_records(records, metrics.read(tmp / "one"))
    assert result["run"]["fast_devices"] == (8 if mesh else 1)
    if mesh == FSDP:
        assert result["run"]["param_spec"] == "P('fsdp',)"


def test_fsdp_holds_an_eighth_of_the_parameters_and_optimizer_state_per_device(runs):
    one, fsdp = runs["eight"]["bytes_one"], runs["eight"]["bytes_fsdp"]
    for figure in ("shards", "arguments"):  # the arrays' shards; the compiled step's inputs
        assert fsdp[figure] <= one[figure] / 8 * 1.05, (figure, fsdp, one)
    assert one["shards"] > 6e6  # Adam's two moments beside 0.5M float32 parameters


def test_tensor_parallelism_halves_the_temporaries_of_an_mlp_block(runs):
    one, tensor = runs["eight"]["mlp_one"], runs["eight"]["mlp_tensor"]
    assert abs(tensor / one - 0.5) <= 0.05, (tensor, one)


def test_a_mesh_that_does_not_fit_names_the_key(runs):
    errors = runs["eight"]
    fit = "the sizes must multiply to 8 (-1: the devices the other axes leave)"
    assert errors["data_3"] == (
        "train.mesh.data=3 x train.mesh.fsdp=1 x train.mesh.tensor=1 does not fit the 8 cpu "
        f"device(s): {fit}"
    )
    assert errors["tensor_3"] == (
        "train.mesh.data=-1 x train.mesh.fsdp=1 x train.mesh.tensor=3 does not fit the 8 cpu "
        f"device(s): {fit}"
    )
    mesh = "data=4 x fsdp=1 x tensor=2 over 8 cpu device(s)"
    for key, case in (("batch_size", "batch_6"), ("eval_batch_size", "eval_batch_6")):
        assert errors[case] == (
            f"train.{key}=6 is not divisible by the 4 devices (data=4 x fsdp=1) the batch is "
            f"split over; use a multiple of 4 ({mesh})"
        )
    # the default mesh puts all 8 devices on data
    assert errors["all_on_data"] == (
        "train.batch_size=4 is not divisible by the 8 devices (data=8 x fsdp=1) the batch is "
        "split over; use a multiple of 8 (data=8 x fsdp=1 x tensor=1 over 8 cpu device(s))"
    )
    assert errors["microbatch_2"] == (
        "train.batch_size=8 / train.microbatches=4: a microbatch of 2 rows is not divisible by "
        "the 4 devices (data=2 x fsdp=2) the batch is split over; use a multiple of 4 "
        "(data=2 x fsdp=2 x tensor=2 over 8 cpu device(s))"
    )
    assert errors["heads_8"].startswith("train.mesh: parameter blocks/0/"), errors["heads_8"]
    assert "(heads) of size 2 is not divisible by the mesh axes tensor=8" in errors["heads_8"]
    assert errors["heads_8"].endswith("or set train.mesh.rules.heads=''")
    assert errors["fits"] is None


LM_MESHES = {"data_fsdp_tensor": MESH, "fsdp": FSDP, "tensor_data": {"data": 4, "tensor": 2}}


@pytest.mark.parametrize("variant", ["hope-tiny", "titans_mac-tiny"])
def test_language_models_on_three_meshes_match_one_device(variant):
    """10 steps of a tiny language model on each mesh, and with 2 microbatches (4 rows each,
    one per batch device) on the first, against one device (in the same process, on its first
    device)."""
    jobs = {"one": ["lm", variant, {}]}
    jobs.update({name: ["lm", variant, mesh] for name, mesh in LM_MESHES.items()})
    jobs["microbatches"] = ["lm", variant, MESH, 2]
    result, _ = finish(start(jobs, devices=8, env={}))
    one = result.pop("one")
    assert len(one) == 10 and np.all(np.isfinite(one))
    for name, losses in result.items():
        np.testing.assert_allclose(losses, one, rtol=1e-5, atol=1e-5, err_msg=name)


# The bytes vocabulary (257) padded to 384 (model.vocab_multiple=128), which tensor=8 divides;
# at tensor=8 the tiny models' 4 heads and Hope's CMS blocks (172 wide) stay whole.
BYTES = {"task.vocab_size": 257, "model.vocab_multiple": 128}
WHOLE = {"train.mesh.rules.heads": "", "train.mesh.rules.mlp": ""}
PADDED_MESHES = {
    "data_fsdp_tensor": (MESH, BYTES),
    "tensor_8": ({"data": 1, "tensor": 8}, {**BYTES, **WHOLE}),
}


@pytest.mark.parametrize("variant", ["hope-tiny", "transformer-tiny"])
def test_a_padded_bytes_vocabulary_trains_on_tensor_meshes_as_on_one_device(variant):
    """10 steps of a tiny language model on the bytes vocabulary, padded, on data=2 x fsdp=2 x
    tensor=2 and on tensor=8 (each with its rules on one device too): the one-device losses.
    Unpadded, tensor=2 stops: "dim 0 (vocab) of size 257 is not divisible"."""
    jobs = {"unpadded": ["error_lm", variant, MESH, {"task.vocab_size": 257}]}
    for name, (mesh, more) in PADDED_MESHES.items():
        jobs[name] = ["lm", variant, mesh, 1, more]
        jobs[f"{name}_one"] = ["lm", variant, {}, 1, more]
    result, _ = finish(start(jobs, devices=8, env={}))
    assert "model.vocab_multiple=128" in result.pop("unpadded")
    for name in PADDED_MESHES:
        one = result[f"{name}_one"]
        assert len(one) == 10 and np.all(np.isfinite(one))
        np.testing.assert_allclose(result[name], one, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_paper_size_model_compiles_for_64_devices_within_80_gb():
    """Transformer++ 1.3B (the largest size of configs/lm.py), its training step compiled for
    data=1 x fsdp=16 x tensor=4 of 64 simulated devices with 8 microbatches and full remat:
    XLA's per-device estimate is under an 80 GB device's memory, and the arguments hold about a
    64th of the parameters and Adam's two moments (float32)."""
    mesh = {"data": 1, "fsdp": 16, "tensor": 4}
    result, _ = finish(start({"pod": ["pod", "transformer-1.3b", mesh, 8]}, devices=64, env={}))
    pod = result["pod"]
    assert pod["devices"] == 64
    assert 1.2e9 < pod["parameters"] < 1.45e9, pod
    state = 3 * 4 * pod["parameters"]  # parameters, Adam's mu and nu
    assert state / 64 < pod["arguments"] < 1.5 * state / 64, pod
    assert pod["bytes"] < 80e9, pod
