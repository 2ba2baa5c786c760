"""The training loop: outputs of a run, exact resumption (after an exception or SIGTERM), the
non-finite stop and skip (patched metrics and real divergence), scanned calls."""

import json
import os
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import tiny_configs

import nested as nl
from nested.core import guards
from nested.levels import recipes
from nested.run import checkpoint, cli, evaluation, locks, metrics, pieces, rundir, stopping, train
from nested.run import config as nc

pytestmark = pytest.mark.usefixtures("compilation_cache")


def comparable(records):
    """The records without wall-clock values (the rest must reproduce exactly)."""
    return [{k: v for k, v in r.items() if k not in metrics.TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted tiny MQAR run: (workdir, summary)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return workdir, train.train_and_evaluate(tiny_configs.config("mqar"), workdir)


def test_a_run_writes_metrics_tensorboard_plot_config_and_checkpoints(finished, capsys):
    workdir, result = finished
    records = metrics.read(workdir)
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == [2, 4, 6, 8]  # log_every=2
    evals = [(r["step"], r["split"]) for r in records if r["split"] != "train"]
    assert evals == [(s, f"seq16_kv{p}") for s in (4, 8) for p in (2, 4)]  # eval_every=4
    for r in records:
        assert all(np.isfinite(v) for k, v in r.items() if k not in ("step", "split"))
    assert {"loss", "accuracy", "grad_norm", "learning_rate", "tokens_per_s"} <= set(records[0])
    assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((workdir / "config.json").read_text())["model"]["dim"] == 16
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]
    final = {r["split"]: r["accuracy"] for r in records if r["step"] == 8 and r["split"] != "train"}
    assert result["mean_accuracy"] == pytest.approx(np.mean(list(final.values())))
    assert result["splits"]["seq16_kv2"]["accuracy"] == final["seq16_kv2"]


class Interrupted(Exception):
    pass


def test_interrupted_run_resumes_to_the_uninterrupted_metrics_exactly(
    finished, tmp_path, monkeypatch
):
    workdir, _ = finished
    original = metrics.MetricWriter.write

    def write_then_die(self, step, split, values):
        record = original(self, step, split, values)
        if step == 6 and split == "train":  # after the checkpoint of step 4, before step 8
            raise Interrupted
        return record

    monkeypatch.setattr(metrics.MetricWriter, "write", write_then_die)
    with pytest.raises(Interrupted):
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    monkeypatch.undo()
    assert [r["step"] for r in metrics.read(tmp_path)][-1] == 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]

    result = train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert comparable(metrics.read(tmp_path)) == comparable(metrics.read(workdir))
    assert result["mean_accuracy"] == finished[1]["mean_accuracy"]
    # resuming a finished run trains nothing and changes nothing
    train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert comparable(metrics.read(tmp_path)) == comparable(metrics.read(workdir))


def _after_step_3(monkeypatch, action):
    """Patch the loop's jitted call: ``action(out) -> out`` runs on the outputs of the call
    that reaches step 3."""
    make = pieces.make_train_fn

    def patched(program, layout=None):
        run = make(program, layout)

        def call(state, batches):
            state, out = run(state, batches)
            return state, action(out) if int(state.step) == 3 else out

        return call

    monkeypatch.setattr(pieces, "make_train_fn", patched)


def _poison(out):
    """A non-finite loss, as nested.core.guards flags it (and counts it in skip mode)."""
    out = {**out, "loss": out["loss"] * np.nan, "finite/loss": out["finite/loss"] < 0}
    if "skipped" in out:
        out["skipped"] = out["skipped"] + 1
    return out


def _signal(signum):
    def send(out):
        os.kill(os.getpid(), signum)
        return out

    return send


def test_non_finite_loss_stops_the_run_naming_step_and_quantity(tmp_path, monkeypatch):
    _after_step_3(monkeypatch, _poison)
    with pytest.raises(guards.NonFiniteError) as info:
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert str(info.value).startswith("step 3: non-finite values in the outer loss; the run stop")
    assert [r["step"] for r in metrics.read(tmp_path)] == [2]


def test_skipped_non_finite_steps_are_counted_and_left_out_of_the_means(
    finished, tmp_path, monkeypatch, capsys
):
    _after_step_3(monkeypatch, _poison)
    config = tiny_configs.config(
        "mqar", train__skip_nonfinite=True, train__max_skipped_fraction=0.125
    )
    result = train.train_and_evaluate(config, tmp_path)
    assert result["skipped_steps"] == 1
    assert capsys.readouterr().out.splitlines()[-2] == "skipped steps: 1 of 8 (non-finite values)"
    logged = {r["step"]: r for r in metrics.read(tmp_path) if r["split"] == "train"}
    reference = {r["step"]: r for r in metrics.read(finished[0]) if r["split"] == "train"}
    assert [logged[s]["skipped"] for s in (2, 4, 6, 8)] == [0, 1, 0, 0]
    assert np.isfinite(logged[4]["loss"]) and logged[4]["loss"] != reference[4]["loss"]
    assert logged[2]["loss"] == reference[2]["loss"]
    assert not any(key.startswith("finite/") for key in logged[2])


def test_several_steps_per_call_give_the_same_run(finished, tmp_path):
    workdir, _ = finished
    config = tiny_configs.config("mqar", train__steps_per_call=2)
    train.train_and_evaluate(config, tmp_path)
    ours, reference = comparable(metrics.read(tmp_path)), comparable(metrics.read(workdir))
    assert [(r["step"], r["split"]) for r in ours] == [(r["step"], r["split"]) for r in reference]
    for a, b in zip(ours, reference, strict=True):
        for key in a:
            if key not in ("step", "split"):
                np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_sigterm_or_ctrl_c_saves_the_step_reached_and_the_run_resumes_exactly(
    finished, tmp_path, monkeypatch, signum
):
    """A real SIGTERM or SIGINT (Ctrl-C) to this process after step 3: the loop saves step 3
    (with the unfinished log window: step 3 of the window 3-4) and raises; the same call
    again ends with the uninterrupted run's metrics."""
    _after_step_3(monkeypatch, _signal(signum))
    before = {s: signal.getsignal(s) for s in stopping.STOP_SIGNALS}
    with pytest.raises(stopping.Stopped) as info:
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    name = signal.Signals(signum).name
    assert str(info.value) == (
        f"stopped by {name} at step 3: its checkpoint is in {checkpoints}; run the same "
        f"command to resume from step 3"
    )
    assert info.value.signum == signum
    assert {s: signal.getsignal(s) for s in stopping.STOP_SIGNALS} == before  # the loop's only
    assert sorted(p.name for p in checkpoints.iterdir()) == ["3"]
    monkeypatch.undo()
    train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert comparable(metrics.read(tmp_path)) == comparable(metrics.read(finished[0]))


def test_sigterm_right_after_a_skipped_save_stops_at_a_step_that_is_saved(tmp_path, monkeypatch):
    """SIGTERM arriving just after the loop decided not to save step 3 (off the period): the
    run must not stop claiming a checkpoint of step 3; it stops at the next step, saved."""
    save = checkpoint.Checkpointer.save

    def signal_after(self, step, state, **kwargs):
        started = save(self, step, state, **kwargs)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return started

    monkeypatch.setattr(checkpoint.Checkpointer, "save", signal_after)
    with pytest.raises(stopping.Stopped) as info:
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert info.value.step == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]


def test_stopped_and_non_finite_runs_end_the_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as info, cli.user_errors():
        raise stopping.Stopped(5, Path("/runs/x/checkpoints"))
    assert info.value.code == 143
    assert capsys.readouterr().err == (
        "stopped by SIGTERM at step 5: its checkpoint is in /runs/x/checkpoints; run the same "
        "command to resume from step 5\n"
    )
    with pytest.raises(SystemExit) as info, cli.user_errors():
        raise stopping.Stopped(5, Path("/runs/x/checkpoints"), signal.SIGINT)
    assert info.value.code == 130
    assert capsys.readouterr().err.startswith("stopped by SIGINT at step 5")
    with pytest.raises(SystemExit) as info, cli.user_errors():
        raise guards.NonFiniteError("step 2: non-finite values in the outer loss; the run stopped")
    assert info.value.code == "error: step 2: non-finite values in the outer loss; the run stopped"


def exploding(name: str = "memory", *, d_k: int, d_v: int, **level_kwargs) -> nl.Level:
    """A linear memory whose SGD step of 1e38 overflows float32 at its first write."""
    return nl.Level(
        name,
        memory=nl.memories.Linear(d_k, d_v),
        objective=nl.objectives.l2,
        update=optax.sgd(1e38),
        **level_kwargs,
    )


def exploding_config(monkeypatch, **overrides):
    monkeypatch.setitem(recipes.RULES, "exploding", exploding)
    config = tiny_configs.config("mqar", **overrides)
    config.levels.memory = nc.level_config("exploding")
    return config


def test_a_diverging_fast_level_stops_the_run_naming_step_level_and_quantity(tmp_path, monkeypatch):
    """End to end, no patched metrics: the fast weights of level 'memory' overflow."""
    with pytest.raises(guards.NonFiniteError) as info:
        train.train_and_evaluate(exploding_config(monkeypatch), tmp_path)
    assert str(info.value) == (
        "step 1: non-finite values in the outer gradients, the outer loss, the fast state of "
        "level 'memory'; the run stopped (lower optimizer.learning_rate or the learning rates "
        "of levels.memory, set optimizer.grad_clip, or skip such steps with "
        "train.skip_nonfinite=True)"
    )
    assert metrics.read(tmp_path) == [] and not list((tmp_path / "checkpoints").iterdir())


SKIP_ALL = {"train__skip_nonfinite": True, "train__steps": 4, "train__eval_every": 4}


def test_skip_nonfinite_end_to_end_counts_every_skipped_step(tmp_path, monkeypatch):
    """Every step diverges: each is skipped and counted, and the parameters stay the
    initial ones (this run allows every step to be skipped)."""
    config = exploding_config(monkeypatch, **SKIP_ALL, train__max_skipped_fraction=1.0)
    assert train.train_and_evaluate(config, tmp_path)["skipped_steps"] == 4
    logged = [r for r in metrics.read(tmp_path) if r["split"] == "train"]
    assert [(r["step"], r["skipped"]) for r in logged] == [(2, 2.0), (4, 2.0)]
    assert all("loss" not in r for r in logged)  # no step's loss enters a mean
    exp = nc.build(config)
    fresh = pieces.init_state(exp, pieces.make_layout(exp))  # the loop's (compiled) init
    with checkpoint.Checkpointer(tmp_path / "checkpoints", every=4, keep=3) as ckpt:
        restored = ckpt.restore_latest(fresh)
    assert restored.step == 4 and int(restored.state.step) == 4
    leaves = zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(fresh.params), strict=True)
    for a, b in leaves:
        np.testing.assert_array_equal(a, b)


def test_a_run_skipping_more_steps_than_allowed_stops_with_the_count(tmp_path, monkeypatch):
    """By default more than a tenth of the steps skipped fails the run: once 1 of 4 steps
    is skipped the model cannot end trained."""
    with pytest.raises(guards.NonFiniteError) as info:
        train.train_and_evaluate(exploding_config(monkeypatch, **SKIP_ALL), tmp_path)
    assert str(info.value) == (
        "step 1: 1 of the run's train.steps=4 steps were skipped as non-finite, more than "
        "train.max_skipped_fraction=0.1 of them; the run stopped (lower "
        "optimizer.learning_rate, set optimizer.grad_clip, or raise train.max_skipped_fraction)"
    )


def test_a_rule_named_by_import_path_trains_and_its_workdir_evaluates_alone(tmp_path, monkeypatch):
    """``levels.memory.rule=module:function``: no registration, and config.json holds the
    path, so evaluating the workdir needs nothing else."""
    (tmp_path / "user_rules_of_test_train.py").write_text(
        "from nested.levels import recipes\n\n\n"
        "def my_delta(name='memory', *, d_k, d_v, **level_kwargs):\n"
        "    return recipes.delta(name, d_k=d_k, d_v=d_v, **level_kwargs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = "user_rules_of_test_train:my_delta"
    workdir = tmp_path / "run"
    result = train.train_and_evaluate(
        tiny_configs.config("mqar", levels__memory__rule=rule), workdir
    )
    assert json.loads((workdir / "config.json").read_text())["levels"]["memory"]["rule"] == rule
    assert evaluation.evaluate_workdir(None, workdir)["splits"] == result["splits"]


def test_a_run_evaluates_with_overrides_of_its_task_and_eval_settings(finished, tmp_path):
    """eval.py's ``--config.task.*`` / ``--config.train.*`` without ``--config``: here the run
    is scored on a setting it was not evaluated on, with one batch."""
    workdir = tmp_path / "run"
    shutil.copytree(finished[0], workdir)
    overrides = ["--config.task.test_settings=((16, 3),)", "--config.train.eval_batches=1"]
    config = cli.workdir_config(str(workdir), overrides)
    assert config.task.test_settings == ((16, 3),) and config.train.eval_batches == 1
    result = evaluation.evaluate_workdir(config, workdir)
    assert result["step"] == 8 and list(result["splits"]) == ["seq16_kv3"]
    assert json.loads((workdir / "eval.json").read_text()) == result


def test_a_smoke_run_of_a_full_config_needs_no_other_override(tmp_path):
    """The tiny model with the shipped config's schedule (700 steps, warmup 50, evaluations
    and checkpoints every 100): ``train.smoke=True`` alone makes it a 10-step check."""
    shipped = nc.load(tiny_configs.path("mqar"))
    config = tiny_configs.config("mqar", train__smoke=True)
    keys = ["steps", "log_every", "eval_every", "checkpoint_every"]
    for section, key in [("optimizer", "warmup_steps"), *[("train", k) for k in keys]]:
        config[section][key] = shipped[section][key]
    assert config.train.steps == 700 and config.optimizer.warmup_steps == 50
    train.train_and_evaluate(config, tmp_path)
    records = metrics.read(tmp_path)
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 11))
    assert {r["step"] for r in records if r["split"] != "train"} == {10}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["steps"] == 10 and saved["optimizer"]["warmup_steps"] == 5


def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_first(tmp_path):
    config = tiny_configs.config("mqar")
    first = locks.Lock(tmp_path / rundir.LOCK_FILE, "test", "test")  # as a running run holds it
    with pytest.raises(locks.Busy) as info:
        train.train_and_evaluate(config, tmp_path)
    message = str(info.value)
    assert message.startswith(f"workdir {tmp_path} is in use by pid {os.getpid()} on host ")
    assert message.endswith("wait for that run to end, stop it, or train in another --workdir")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.json").exists()
    first.release()
    train.train_and_evaluate(config, tmp_path)  # the lock of an ended holder is free
    assert not (tmp_path / rundir.LOCK_FILE).exists()  # and a finished run leaves none
