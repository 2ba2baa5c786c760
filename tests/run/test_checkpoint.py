"""Checkpoints (orbax, wrapped) and session memory states."""

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

from nested.run import checkpoint, evaluation, fingerprint, memory_state, pieces, rundir
from nested.run import config as nc

pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def continual():
    """A tiny continual experiment (its memory level carries its state across sequences),
    with a fresh state and a state one training step in (every part of it non-trivial), made
    on the device layout the training loop and ``evaluate_workdir`` use (so their compiled
    programs are shared through the compilation cache)."""
    exp = nc.build(tiny_configs.config("continual"))
    layout = pieces.make_layout(exp)
    fresh = pieces.init_state(exp, layout)
    batches = pieces.stacked_batches(exp.task, 0, 1, exp.config.train.batch_size)
    state, _ = pieces.make_train_fn(exp.program, layout)(fresh, batches)
    return exp, fresh, state


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_gives_back_the_whole_state_and_data_position(tmp_path, continual):
    _, fresh, state = continual
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        assert ckpt.save(1, state, data_position=17)
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        restored = ckpt.restore_latest(fresh)
    assert (restored.step, restored.data_position) == (1, 17)
    assert_trees_equal(restored.state, state)  # params, optimizer, fast states, step, key
    assert state.fast is not None and int(restored.state.step) == 1


def test_extra_is_saved_as_it_was_when_save_was_called(tmp_path, continual):
    """The write is async; the training loop keeps appending to its log window after save()."""
    _, fresh, state = continual
    window = [{"loss": 1.0}]
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        ckpt.save(1, state, data_position=1, extra={"window": window})
        window.append({"loss": 2.0})
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        assert ckpt.restore_latest(fresh).extra == {"window": [{"loss": 1.0}]}


def test_saves_every_n_steps_and_keeps_the_latest_k(tmp_path, continual):
    _, _, state = continual
    with checkpoint.Checkpointer(tmp_path, every=2, keep=2) as ckpt:
        started = [ckpt.save(step, state, data_position=step) for step in range(1, 8)]
        assert not ckpt.save(6, state, data_position=6, force=True)  # exists already
        assert ckpt.save(7, state, data_position=7, force=True)  # forced off-period
        ckpt.wait()
        assert ckpt.steps() == [6, 7]
    assert started == [False, True, False, True, False, True, False]


# A failed read can leave orbax's other pending reads to die later (the library collects
# them at once, but it is a race): their "exception ignored" reports are not the test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["empty folder", "truncated files"])
def test_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(
    tmp_path, continual, damage, caplog
):
    _, fresh, state = continual
    later = state.replace(step=state.step + 1)
    with checkpoint.Checkpointer(tmp_path, every=1, keep=3) as ckpt:
        ckpt.save(1, state, data_position=1)
        ckpt.save(2, later, data_position=2)
    if damage == "empty folder":
        shutil.rmtree(tmp_path / "2")
        (tmp_path / "2").mkdir()
    else:  # every data file cut in half: OCDBT may leave files the final tree no longer
        # references (parallel writes), so cutting one file is not always damage
        for path in (tmp_path / "2" / "state").rglob("*"):
            if path.is_file() and path.parent.name == "d":
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with (
        caplog.at_level(logging.WARNING),
        checkpoint.Checkpointer(tmp_path, every=1, keep=3) as ckpt,
    ):
        restored = ckpt.restore_latest(fresh)
        assert ckpt.steps() == [1]
    assert restored.step == 1 and restored.data_position == 1
    assert_trees_equal(restored.state, state)
    # (asyncio logs orbax's abandoned reads too; their text holds tmp_path, "...damaged...")
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint")]
    assert len(reports) == 1 and "\n" not in reports[0]
    assert reports[0].startswith("checkpoint step 2 is damaged (")
    assert (tmp_path / "2.damaged").is_dir()


def test_checkpoint_of_another_model_is_an_error_not_damage(tmp_path, continual):
    _, _, state = continual
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        ckpt.save(1, state, data_position=1)
    other = pieces.init_state(nc.build(tiny_configs.config("continual", model__dim=8)))
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        with pytest.raises(checkpoint.CheckpointError, match="checkpoint step 1 in .* is of an"):
            ckpt.restore_latest(other)
        assert ckpt.steps() == [1]  # left alone


def _session(exp, state, split):
    """A memory session over the held-out batches of ``split`` (memory carried)."""
    results, fast = evaluation.evaluate(
        pieces.make_eval_fn(exp.program, pieces.make_layout(exp)),
        state,
        exp.task,
        batches=2,
        batch_size=exp.config.train.batch_size,
        splits=[split],
        carry=True,
    )
    return results[split], fast


def test_memory_state_save_load_continues_the_stream_identically(tmp_path, continual):
    exp, _, state = continual
    first, after_first = _session(exp, state, "task0")
    second, after_second = _session(exp, state.replace(fast=after_first), "task1")

    memory_state.save(tmp_path / "memory", after_first)
    loaded = memory_state.load(tmp_path / "memory", like=state.fast)
    assert_trees_equal(loaded, after_first)
    resumed, after_resumed = _session(exp, state.replace(fast=loaded), "task1")
    assert resumed == second  # exactly: the next session continues where the first stopped
    assert_trees_equal(after_resumed, after_second)
    # the memory carried something: starting the second session fresh changes its result
    fresh, _ = _session(exp, state, "task1")
    assert fresh != second

    memory_state.save(tmp_path / "memory", after_second)  # sessions overwrite in place
    assert_trees_equal(memory_state.load(tmp_path / "memory", like=state.fast), after_second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory"]


def test_memory_state_of_another_model_or_path_is_refused(tmp_path, continual):
    _, _, state = continual
    memory_state.save(tmp_path / "memory", state.fast)
    wider = jax.tree.map(lambda x: jnp.concatenate([x, x]), state.fast)  # batch size 8
    with pytest.raises(ValueError, match="does not fit this model .*batch size it was saved"):
        memory_state.load(tmp_path / "memory", like=wider)
    with pytest.raises(ValueError, match="no memory state at"):
        memory_state.load(tmp_path / "nothing", like=state.fast)
    with pytest.raises(ValueError, match="no level of this system keeps its state"):
        memory_state.save(tmp_path / "none", None)


def _workdir(path, exp, state, step=1):
    """A workdir holding the checkpoint of ``state`` at ``step``, as training leaves it."""
    with checkpoint.Checkpointer(path / rundir.CHECKPOINTS, every=1, keep=1) as ckpt:
        ckpt.save(step, state, data_position=step)
    rundir.record_config(exp.config, path, step)
    return path


def test_workdir_sessions_save_and_load_the_memory(tmp_path, continual):
    """``evaluate_workdir`` (eval.py) with --save_memory, then --load_memory: the second
    session continues the first's memory exactly; each session's results are a line of
    sessions.jsonl, and each memory state carries the fingerprint of its model."""
    exp, _, state = continual
    workdir = _workdir(tmp_path / "run", exp, state)
    one, two = tmp_path / "one", tmp_path / "two"
    first = evaluation.evaluate_workdir(None, workdir, save_memory=one)
    second = evaluation.evaluate_workdir(None, workdir, load_memory=one, save_memory=two)
    lines = (workdir / rundir.SESSIONS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [first, second]
    assert (first["load_memory"], first["save_memory"]) == (None, str(one))
    assert (second["load_memory"], second["save_memory"]) == (str(one), str(two))
    assert not (workdir / rundir.EVAL_FILE).exists()
    for path in (one, two):
        assert checkpoint.load_meta(path)["fingerprint"] == fingerprint.of(exp.config, 1)

    eval_fn = pieces.make_eval_fn(exp.program, pieces.make_layout(exp))
    expected_first, fast = evaluation.evaluate(
        eval_fn, state, exp.task, batches=2, batch_size=4, carry=True
    )
    expected_second, fast = evaluation.evaluate(
        eval_fn,
        state.replace(fast=fast),
        exp.task,
        batches=2,
        batch_size=4,
        carry=True,
    )
    assert first["splits"] == {s: {"step": 1, "split": s, **v} for s, v in expected_first.items()}
    assert second["splits"] == {s: {"step": 1, "split": s, **v} for s, v in expected_second.items()}
    assert_trees_equal(memory_state.load(two, like=state.fast), fast)
    with pytest.raises(nc.ConfigError, match="a memory session needs a level with persist='str"):
        config = tiny_configs.config("continual", levels__memory__persist="sequence")
        evaluation.evaluate_workdir(config, workdir, save_memory=one)


def test_a_memory_state_of_another_architecture_is_refused(tmp_path, continual):
    """A session of the delta model, loaded into the gated_delta one: the fast states have
    the same levels and shapes, the models compute differently; the fingerprint tells."""
    exp, _, state = continual
    session = tmp_path / "delta_session"
    memory_state.save(session, state.fast, fingerprint=fingerprint.of(exp.config, 1))
    gated = nc.build(tiny_configs.config("continual", levels__memory__rule="gated_delta"))
    workdir = _workdir(
        tmp_path / "gated", gated, pieces.init_state(gated, pieces.make_layout(gated))
    )
    with pytest.raises(memory_state.MemoryStateError) as info:
        evaluation.evaluate_workdir(None, workdir, load_memory=session)
    assert str(info.value).startswith(
        f"the memory state at '{session}' was written by another model (architecture "
    )
    assert str(info.value).endswith("load it into the model that wrote it")


def test_a_memory_state_of_other_slow_weights_loads_with_a_warning(tmp_path, continual, caplog):
    exp, _, state = continual
    path = tmp_path / "memory"
    memory_state.save(path, state.fast, fingerprint=fingerprint.of(exp.config, 1))
    with caplog.at_level(logging.WARNING):
        loaded = memory_state.load(path, like=state.fast, fingerprint=fingerprint.of(exp.config, 2))
    assert_trees_equal(loaded, state.fast)
    assert [r.getMessage() for r in caplog.records] == [
        f"the memory state at '{path}' was written with the slow weights of step 1, these are "
        "of step 2"
    ]
    memory_state.save(path, state.fast)  # from Python, without a fingerprint
    with pytest.raises(memory_state.MemoryStateError, match="carries no model fingerprint"):
        memory_state.load(path, like=state.fast, fingerprint=fingerprint.of(exp.config, 1))
    assert_trees_equal(memory_state.load(path, like=state.fast), state.fast)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_arrays_that_read_back_different_from_the_saved_ones_are_damage(
    tmp_path, continual, caplog
):
    """Files that read without error but hold other values (here: step 1's arrays under
    step 2) fail the fingerprint check: step 2 is set aside and step 1 restored."""
    _, fresh, state = continual
    with checkpoint.Checkpointer(tmp_path, every=1, keep=3) as ckpt:
        ckpt.save(1, state, data_position=1)
        ckpt.save(2, state.replace(step=state.step + 1), data_position=2)
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
    with (
        caplog.at_level(logging.WARNING),
        checkpoint.Checkpointer(tmp_path, every=1, keep=3) as ckpt,
    ):
        restored = ckpt.restore_latest(fresh)
    assert restored.step == 1
    assert_trees_equal(restored.state, state)
    reports = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(reports) == 1
    assert reports[0].startswith(
        "checkpoint step 2 is damaged (its arrays differ from the saved ones: .step () int32)"
    )


def test_fingerprint_sees_every_bit_and_position():
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    base = checkpoint.fingerprint({"x": x})
    flipped = x.at[1, 2].set(jnp.nextafter(x[1, 2], jnp.float32(10)))  # one ulp
    assert checkpoint.fingerprint({"x": flipped}) != base
    assert checkpoint.fingerprint({"x": x[::-1]}) != base  # same values, other places
    assert checkpoint.fingerprint({"x": x}) == base
    key = {"k": jax.random.key(0), "b": jnp.array([True, False]), "d": jnp.ones(3)}
    assert len(checkpoint.fingerprint(key)) == 3  # keys, bools and float64 are covered


def test_checkpoint_of_other_dtypes_is_another_model(tmp_path, continual):
    _, fresh, state = continual
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
        ckpt.save(1, state, data_position=1)
    half = fresh.replace(params=jax.tree.map(lambda x: x.astype(jnp.float16), fresh.params))
    with (
        checkpoint.Checkpointer(tmp_path, every=1, keep=2) as ckpt,
        pytest.raises(checkpoint.CheckpointError) as info,
    ):
        ckpt.restore_latest(half)
    message = str(info.value)
    assert message.startswith(f"checkpoint step 1 in {tmp_path} is of another model (saved ")
    saved, expected = message.split(", expected ")
    assert saved.endswith(' float32"') and expected.startswith('"') and ' float16"' in expected
    assert message.endswith("; use a new workdir or the config it was trained with")


def test_a_memory_a_task_of_agents_would_discard_is_refused_before_compiling(tmp_path):
    """Eval batches of a task with agents start a new agent in every row: a loaded memory
    would be replaced before it is read, the results identical with or without it."""
    exp = nc.build(tiny_configs.config("continual", task__agent_every=2))
    state = pieces.init_state(exp, pieces.make_layout(exp))
    workdir = _workdir(tmp_path / "agents", exp, state)
    session = tmp_path / "m1"
    memory_state.save(session, state.fast, fingerprint=fingerprint.of(exp.config, 1))
    with pytest.raises(nc.ConfigError, match="starts a new agent in every row at its first task0"):
        evaluation.evaluate_workdir(None, workdir, load_memory=session)
    config = tiny_configs.config("continual", task__agent_every=0)  # the way it says
    assert evaluation.evaluate_workdir(config, workdir, load_memory=session)["load_memory"]
