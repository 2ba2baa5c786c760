"""Bad input that no other test file covers: each gets a clear message, or works as stated.

The table of every bad input and what it gets is in WORKSPACE.md ("Bad input and what it
gets"); its rows name the test asserting each message, here or in the other test files.
"""

import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

from nested import data, ops
from nested.learn import rules
from nested.run import checkpoint, cli, evaluation, memory_state, pieces, rundir, train
from nested.run import config as nc

pytestmark = pytest.mark.usefixtures("compilation_cache")


def error(config) -> str:
    with pytest.raises(nc.ConfigError) as info:
        nc.build(config)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- config values of the wrong type or range (build, before anything is traced) --------------

CONFIG_CASES = {
    "float step count": ({"train__steps": 2.5}, "train.steps=2.5 must be an int >= 1"),
    "bool batch size": ({"train__batch_size": True}, "train.batch_size=True must be an int >= 1"),
    "zero eval batches": ({"train__eval_batches": 0}, "train.eval_batches=0 must be an int >= 1"),
    "string flag": (
        {"train__skip_nonfinite": "yes"},
        "train.skip_nonfinite='yes' must be True or False",
    ),
    "negative seed": ({"seed": -1}, "seed=-1 must be an int >= 0"),
    "string period": (
        {"levels__memory__every": "2"},
        "levels.memory.every='2' must be an int >= 1",
    ),
    "zero chunk": ({"levels__memory__chunk": 0}, "levels.memory.chunk=0 must be an int >= 1"),
    "zero heads": ({"model__heads": 0}, "model.dim=16 and model.heads=0 must be ints >= 1"),
    "float width": ({"model__dim": 16.0}, "model.dim=16.0 and model.heads=2 must be ints >= 1"),
    "missing learning rate": (
        {"optimizer__learning_rate": None},
        "optimizer.learning_rate=None must be a positive number",
    ),
    "negative learning rate": (
        {"optimizer__learning_rate": -0.1},
        "optimizer.learning_rate=-0.1 must be a positive number",
    ),
    "warmup as long as the run": (
        {"optimizer__warmup_steps": 8},
        "optimizer.warmup_steps=8 must be an int in [0, train.steps=8); lower it, or set "
        "train.smoke=True for a short check run",
    ),
    "logs off the calls": (
        {"train__steps_per_call": 2, "train__log_every": 3},
        "train.log_every=3 is not a multiple of train.steps_per_call=2; allowed: multiples of "
        "2, or train.steps=8 and more (at the end only)",
    ),
    "skipped fraction above 1": (
        {"train__max_skipped_fraction": 1.5},
        "train.max_skipped_fraction=1.5 must be a number in [0, 1]",
    ),
    "string smoke flag": ({"train__smoke": "yes"}, "train.smoke='yes' must be True or False"),
    "vocabulary too small for the task": (
        {"task__vocab_size": 3},
        "task: mqar: vocab_size=3 is invalid: 2 distinct keys need vocab_size // 2 - 1 >= 2, "
        "i.e. vocab_size >= 6",
    ),
    "typo in the mesh": (
        {"train__mesh__dta": 2},
        "train.mesh.dta is not a key of train.mesh; allowed: ['data', 'fsdp', 'rules', 'tensor']",
    ),
    "negative mesh axis": (
        {"train__mesh__data": -2},
        "train.mesh.data=-2 must be an int >= 1, or -1 for the rest",
    ),
    "zero tensor axis": (
        {"train__mesh__tensor": 0},
        "train.mesh.tensor=0 must be an int >= 1, or -1 for the rest",
    ),
    "two axes take the rest": (
        {"train__mesh__fsdp": -1},
        "train.mesh: train.mesh.data=-1 and train.mesh.fsdp=-1: at most one axis takes the "
        "rest of the devices",
    ),
    "a rule names an unknown mesh axis": (
        {"train__mesh__rules__mlp": "model"},
        "train.mesh.rules.mlp='model' names the axis 'model', which the mesh lacks; mesh axes: "
        "['data', 'fsdp', 'tensor']",
    ),
    "a rule that is not a string": (
        {"train__mesh__rules__embed": 1},
        "train.mesh.rules.embed=1 must be a string of mesh axes, e.g. 'fsdp' or 'data,fsdp' "
        "('' keeps the dimension whole)",
    ),
    "microbatches that do not divide the batch": (
        {"train__microbatches": 3},
        "train.microbatches=3 does not divide train.batch_size=4; allowed: [1, 2, 4]",
    ),
    "an unknown remat policy": (
        {"model__remat": "some"},
        "model: remat='some' is unknown; use one of ['none', 'full', 'save_dots', "
        "'save_dots_no_batch']",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_value_of_wrong_type_or_range(case):
    overrides, message = CONFIG_CASES[case]
    config = tiny_configs.config("mqar")
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        with node.ignore_type():
            node[leaf] = value
    assert error(config) == message


# -- sequences shorter than a chunk or a period ------------------------------------------------


def first_loss(**overrides) -> float:
    """The loss of the first training step of the tiny MQAR run (16-token sequences), built
    as the training loop builds it (the default config's program is then the loop's, compiled
    once per test session through the compilation cache)."""
    exp = nc.build(tiny_configs.config("mqar", **overrides))
    layout = pieces.make_layout(exp)
    batches = pieces.stacked_batches(exp.task, 0, 1, exp.config.train.batch_size)
    _, out = pieces.make_train_fn(exp.program, layout)(pieces.init_state(exp, layout), batches)
    return float(out["loss"][0])


def test_sequence_shorter_than_a_chunk_works_and_equals_one_chunk():
    """A chunk of 32 (the delta rule's default) on 16-token sequences is one partial chunk;
    it gives the loss of a chunk of exactly the sequence, to the bit."""
    assert ops.chunked.default_chunk_size() == 32
    short = first_loss()
    assert short == first_loss(levels__memory__chunk=32)
    assert short == first_loss(levels__memory__chunk=16)


def test_period_longer_than_the_sequence_runs_as_one_partial_update_chunk():
    """``every=32`` on 16-token sequences: one partial update chunk, every gradient taken at
    the sequence-start memory (mini-batch TTT), the same loss as ``every=16``; the state it
    ends with only matters to a level that carries it (``persist="stream"``, where the config
    requires ``every`` to divide the sequence: tests/run/test_config.py)."""
    long = first_loss(levels__memory__every=32, levels__memory__chunk=32)
    assert long == first_loss(levels__memory__every=16, levels__memory__chunk=16)


# -- data the model would misread -----------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_stop_the_run(tmp_path, monkeypatch):
    """The embedding gather would clamp them silently; the loop checks every batch."""
    batch = data.MQARTask.batch

    def shifted(self, index, batch_size, *, split="train"):
        b = batch(self, index, batch_size, split=split)
        return b._replace(inputs=b.inputs + (index == 1) * self.vocab_size)

    monkeypatch.setattr(data.MQARTask, "batch", shifted)
    with pytest.raises(nc.ConfigError) as info:
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert str(info.value).startswith(
        "task mqar: training batch 1: inputs holds token ids in [16, "
    )
    assert str(info.value).endswith(
        "], outside [0, 16) (task.vocab_size); raise task.vocab_size or fix the task's data"
    )


def test_batches_of_mismatched_shapes_or_float_tokens_are_refused():
    good = {"inputs": np.zeros((2, 5), np.int32), "targets": np.zeros((2, 5), np.int32)}
    pieces.check_arrays({**good, "mask": np.ones((2, 5), np.float32)}, 16, "here")
    with pytest.raises(nc.ConfigError, match=r"^here: mask has shape \(2, 4\), inputs \(2, 5\)"):
        pieces.check_arrays({**good, "mask": np.ones((2, 4), np.float32)}, 16, "here")
    with pytest.raises(nc.ConfigError, match="^here: targets must hold integer token ids, got"):
        pieces.check_arrays({**good, "targets": np.zeros((2, 5), np.float32)}, 16, "here")


# -- workdirs ---------------------------------------------------------------------------------


def test_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "run"
    path.write_text("")
    with pytest.raises(nc.ConfigError, match=f"^workdir {path} is a file; pass a folder"):
        train.train_and_evaluate(tiny_configs.config("mqar"), path)


def test_a_refused_command_changes_nothing_in_the_run(tmp_path):
    """Lowering train.steps below a run's checkpoint would silently skip training; a config of
    another model does not fit the checkpoint. Both are refused, and the run's record of its
    config (what eval.py builds the model from) is left as it was."""
    config = tiny_configs.config("mqar")
    exp = nc.build(config)
    with checkpoint.Checkpointer(tmp_path / "checkpoints", every=4, keep=1) as ckpt:
        ckpt.save(8, pieces.init_state(exp, pieces.make_layout(exp)), data_position=8)
    rundir.record_config(exp.config, tmp_path, 0)
    record = (tmp_path / "config.json").read_bytes()
    with pytest.raises(nc.ConfigError) as info:
        train.train_and_evaluate(tiny_configs.config("mqar", train__steps=4), tmp_path)
    assert str(info.value) == (
        f"train.steps=4 is below the step 8 of the checkpoint in {tmp_path / 'checkpoints'}; "
        f"set train.steps >= 8 or use a new workdir"
    )
    with pytest.raises(checkpoint.CheckpointError, match="^checkpoint step 8 in .* is of anot"):
        train.train_and_evaluate(tiny_configs.config("mqar", model__dim=8), tmp_path)
    assert (tmp_path / "config.json").read_bytes() == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.json"]


def test_resuming_with_a_changed_config_warns_and_keeps_the_config_it_replaces(tmp_path, caplog):
    """The config of steps 0-8 stays on record as config.8.json when a run resumed at step 8
    continues with another."""
    rundir.record_config(tiny_configs.config("mqar"), tmp_path, 0)
    first = (tmp_path / "config.json").read_text()
    changed = tiny_configs.config("mqar", optimizer__learning_rate=0.5, train__steps=16)
    with caplog.at_level(logging.WARNING):
        rundir.record_config(changed, tmp_path, 8)
    assert [r.getMessage() for r in caplog.records] == [
        f"config differs from the one saved in {tmp_path / 'config.json'}: "
        f"['optimizer.learning_rate', 'train.steps']; that one is kept as "
        f"{tmp_path / 'config.8.json'}"
    ]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 16
    assert (tmp_path / "config.8.json").read_text() == first


def test_unreadable_config_json(tmp_path, caplog):
    """A truncated config.json (a disk filled up, a hand edit): training replaces it with a
    warning; evaluation, which needs it, says what to pass."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text('{"seed": 0, "task": {')
    with pytest.raises(nc.ConfigError, match=r"config.json is not a readable config \(.*--config$"):
        rundir.load_workdir_config(tmp_path)
    with caplog.at_level(logging.WARNING):
        rundir.record_config(tiny_configs.config("mqar"), tmp_path, 0)
    assert "is unreadable (" in caplog.records[0].getMessage()
    assert rundir.load_workdir_config(tmp_path).model.dim == 16


def test_evaluating_a_workdir_without_a_run(tmp_path):
    """Each message says what is missing; all come before anything is compiled."""
    config = tiny_configs.config("mqar")
    for given in (None, config):
        with pytest.raises(nc.ConfigError) as info:
            evaluation.evaluate_workdir(given, tmp_path)
        assert str(info.value) == (
            f"no run in --workdir {tmp_path} (no checkpoints folder): train one there first "
            f"(experiments/train.py --workdir {tmp_path})"
        )
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(nc.ConfigError, match=f"^--workdir {tmp_path} has no config.json; pass"):
        evaluation.evaluate_workdir(None, tmp_path)
    missing = tmp_path / "nothing"
    with pytest.raises(memory_state.MemoryStateError) as info:
        evaluation.evaluate_workdir(tiny_configs.config("continual"), tmp_path, load_memory=missing)
    assert str(info.value) == (
        f"no memory state at '{missing}'; save one first (eval.py --save_memory)"
    )
    assert isinstance(info.value, cli.USER_ERRORS)  # the entry points print one line
    with pytest.raises(checkpoint.CheckpointError, match="^no readable checkpoint in "):
        evaluation.evaluate_workdir(config, tmp_path)


CORPORA = {  # case -> (what task.path names, part of the message)
    "missing": ("nope", "does not exist; give a text file or a folder"),
    "empty folder": ("empty", "has 0 file(s) matching glob='*'"),
    "empty file": ("e.txt", "the train split of path="),
}


@pytest.mark.parametrize("case", list(CORPORA))
def test_a_char_lm_corpus_that_cannot_make_batches_is_refused_before_the_workdir(tmp_path, case):
    """The corpus is read when a first batch is made: the run makes one of each split before
    it creates the workdir or compiles anything."""
    name, message = CORPORA[case]
    if case == "empty folder":
        (tmp_path / name).mkdir()
    elif case == "empty file":
        (tmp_path / name).write_bytes(b"")
    config = nc.load(tiny_configs.path("char_lm"))
    config.task.path = str(tmp_path / name)
    workdir = tmp_path / "run"
    with pytest.raises(nc.ConfigError) as info:
        train.train_and_evaluate(config, workdir)
    assert str(info.value).startswith("task: char_lm: ") and "\n" not in str(info.value)
    assert f"path='{config.task.path}'" in str(info.value) and message in str(info.value)
    assert not workdir.exists()


def test_memory_state_of_other_dtypes(tmp_path):
    fast = {"memory": jnp.zeros((2, 3), jnp.float32)}
    memory_state.save(tmp_path / "m", fast)
    half = {"memory": fast["memory"].astype(jnp.float16)}
    with pytest.raises(ValueError, match=r"does not fit this model \(saved .*float32.*float16"):
        memory_state.load(tmp_path / "m", like=half)


# -- op-level arrays ------------------------------------------------------------------------------


def test_op_inputs_of_mixed_float_dtypes_compute_in_the_wider_one():
    """JAX's promotion: float32 queries with float64 keys give float64 outputs (no error,
    nothing lost); integer arrays and empty sequences are refused (tests/ops/test_ops_linear.py)."""
    k = jax.random.normal(jax.random.key(0), (1, 5, 2, 4))
    q = k.astype(jnp.float32)
    beta = jnp.full((1, 5, 2), 0.5, jnp.float32)
    o, state = ops.delta_rule(q, k, q, beta)
    assert o.dtype == state.dtype == jnp.float64
    with pytest.raises(ValueError) as info:
        ops.delta_rule(q[:, :0], q[:, :0], q[:, :0], beta[:, :0])
    assert str(info.value) == "`q` must hold at least one token (T >= 1), got T = 0."


def test_op_arrays_of_the_wrong_shape_or_dtype_name_the_argument():
    """Checked on shapes before tracing; the message names the argument and the shape it
    must have (tests/ops/test_ops_linear.py covers every argument of every op)."""
    q = jnp.zeros((1, 5, 2, 4))
    beta = jnp.full((1, 5, 2), 0.5)
    calls = {
        "`k` must have shape (B, T, H, d_k) = (1, 5, 2, 4) like `q`, got (1, 5, 2, 3).": (
            lambda: ops.delta_rule(q, q[..., :3], q, beta)
        ),
        "`beta` must have shape (B, T, H) = (1, 5, 2), got (1, 5).": (
            lambda: ops.delta_rule(q, q, q, beta[..., 0])
        ),
        "`q` must be a floating array, got dtype int32.": (
            lambda: ops.delta_rule(q.astype(jnp.int32), q.astype(jnp.int32), q, beta)
        ),
    }
    for message, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


# -- gates: in range by construction, whatever the projections emit ------------------------


def test_gates_stay_in_their_ranges_for_any_pre_activation():
    """A diverging owner can emit any pre-activation: a ``unit`` gate (write strengths,
    retentions) stays in [0, scale], a ``positive`` one (learning rates) >= 0 and a
    ``log_decay`` <= 0 (a decay ``exp(.)`` in [0, 1]), finite, in float32 and float64; the
    ranges are open wherever the float type can tell the bound apart (|pre| <= 10 here)."""
    for dtype in (jnp.float32, jnp.float64):
        pre = jnp.array([-1e30, -1e4, -100.0, -10.0, 0.0, 10.0, 100.0, 1e4, 1e30], dtype)
        inner = slice(3, 6)  # -10, 0, 10
        for scale in (1.0, 0.1):
            unit = rules.Gate("unit", scale=scale).activate(pre)
            positive = rules.Gate("positive", scale=scale).activate(pre)
            decay = jnp.exp(rules.Gate("log_decay", scale=scale).activate(pre))
            for gate in (unit, positive, decay):
                assert gate.dtype == dtype and bool(jnp.all(jnp.isfinite(gate)))
            assert bool(jnp.all((unit >= 0) & (unit <= scale) & (positive >= 0)))
            assert bool(jnp.all((decay >= 0) & (decay <= 1)))
            for gate, high in ((unit[inner], scale), (decay[inner], 1.0)):
                assert bool(jnp.all((gate > 0) & (gate < high)))
            assert bool(jnp.all(positive[inner] > 0))
        bias = rules.Gate("unit", init=0.9).bias()  # the projection's bias gives ``init``
        assert rules.Gate("unit").activate(jnp.asarray(bias, dtype)) == pytest.approx(0.9)


# -- config files the command line cannot load -------------------------------------------------


FILES = {
    "raises": ("def get_config():\n    raise KeyError('dim')\n", "get_config() failed: dim"),
    "has no get_config": ("x = 1\n", "get_config() failed: module 'bad' has no attribute"),
    "does not parse": ("def get_config(:\n", "get_config() failed: invalid syntax"),
}


@pytest.fixture(scope="module")
def bad_file_runs(tmp_path_factory):
    """``experiments/train.py`` on each bad file; the processes (mostly Python start-up) run
    side by side. Maps each case to (path, exit status, stderr)."""
    tmp = tmp_path_factory.mktemp("bad_files")
    started = {}
    for i, (case, (source, _)) in enumerate(FILES.items()):
        folder = tmp / str(i)
        folder.mkdir()
        path = folder / "bad.py"
        path.write_text(source)
        command = [sys.executable, str(tiny_configs.ROOT / "experiments" / "train.py")]
        command += [f"--config={path}", f"--workdir={folder / 'w'}"]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started[case] = path, process
    runs = {}
    for case, (path, process) in started.items():
        _, err = process.communicate(timeout=120)
        runs[case] = path, process.returncode, err
    return runs


@pytest.mark.parametrize("case", list(FILES))
def test_config_file_that_cannot_be_loaded(bad_file_runs, case):
    path, returncode, err = bad_file_runs[case]
    lines = [line for line in err.splitlines() if line.strip()]
    assert returncode == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: --config {path}: {FILES[case][1]}"), lines[0]
