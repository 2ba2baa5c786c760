"""Deployment, the continual-learning matrix, the regret utility and the report on a tiny run."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_configs

from nested.core.level import InitialState
from nested.plasticity import alignment, capacity, regret, report, transfer
from nested.plasticity.deployment import HELD_OUT, Deployment, stream_batches, task_batches
from nested.run import config as nc
from nested.run import loading, memory_state, metrics, train

B = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny continual config trained a few steps (its memory carries across sequences),
    logging the alignment of its updates every 4 steps."""
    workdir = tmp_path_factory.mktemp("continual")
    train.train_and_evaluate(tiny_configs.config("continual", plasticity__every=4), workdir)
    return workdir, loading.load_trained(workdir)


@pytest.mark.slow
def test_training_logs_the_alignment_figures(trained):
    workdir, _ = trained
    records = metrics.read(workdir)
    logged = [r for r in records if r["split"] == metrics.PLASTICITY]
    assert [r["step"] for r in logged] == [4, 8]
    assert -1 <= logged[-1]["memory/cos_local"] <= 1 and logged[-1]["memory/conflict_local"] >= 0
    assert set(metrics.final_eval(records)) == {"task0", "task1"}  # not an evaluation


def test_alignment_in_training_refuses_what_it_cannot_measure(tmp_path):
    config = tiny_configs.config("mqar", plasticity__every=2)
    config.model.cms = ("cms1",)
    config.levels.cms1 = nc.level_config("cms", every=16)
    with pytest.raises(nc.ConfigError, match="plasticity.every: level 'memory' cannot be probed"):
        train.train_and_evaluate(config, tmp_path / "run")
    config = tiny_configs.config("mqar", plasticity__form="two_step")
    with pytest.raises(nc.ConfigError, match=r"plasticity.form='two_step' is unknown"):
        nc.build(config)


@pytest.fixture(scope="module")
def deployed(trained):
    _, run = trained
    return run, Deployment(run.program, run.state.params, B), task_batches(run.experiment.task, B)


def test_deployment_keeps_the_slow_weights_and_a_saved_memory_resumes(deployed, tmp_path):
    run, deployment, batch_of = deployed
    before = jax.tree.map(np.array, run.state.params)
    fast, _ = deployment.session(deployment.fresh(), [batch_of(0, i) for i in range(2)])
    memory_state.save(tmp_path / "m", fast, fingerprint=run.fingerprint)
    later = [batch_of(1, i) for i in range(2)]
    _, direct = deployment.session(fast, later)
    restored = memory_state.load(tmp_path / "m", like=fast, fingerprint=run.fingerprint)
    _, resumed = deployment.session(restored, later)
    for a, b in zip(direct, resumed, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    after = jax.tree.map(np.array, run.state.params)
    jax.tree.map(np.testing.assert_array_equal, before, after)  # bitwise
    assert not np.array_equal(
        direct[0]["loss"], deployment.session(deployment.fresh(), later)[1][0]["loss"]
    )


def test_transfer_matrix_shapes_and_its_summary_is_the_metrics_of_R(deployed):
    _, deployment, batch_of = deployed
    out = transfer.transfer_matrix(
        deployment, batch_of, [1, 0], sessions=2, session_length=1, eval_batches=1
    )
    R, b, Z = out["R"]["accuracy"], out["b"]["accuracy"], out["curves"]["accuracy"]
    assert R.shape == (2, 2) and b.shape == (2,) and Z.shape == (2, 3)
    assert np.all((R >= 0) & (R <= 1)) and "memory_accuracy" in out["R"]
    np.testing.assert_allclose(Z[:, -1], np.diag(R))  # a phase's last session is its row
    assert out["summary"]["accuracy"] == transfer.summary(R, b, Z)
    with pytest.raises(ValueError, match=r"tasks=\[0, 0\]: name each task once"):
        transfer.transfer_matrix(
            deployment, batch_of, [0, 0], sessions=1, session_length=1, eval_batches=1
        )


def test_windowed_matrix_on_a_stream(deployed):
    run, deployment, _ = deployed
    batch_at = stream_batches(run.experiment.task, B)
    out = transfer.windowed_matrix(
        deployment, batch_at, windows=2, window_batches=2, eval_batches=1
    )
    assert out["R"]["loss"].shape == (2, 2)
    with pytest.raises(ValueError, match=r"eval_batches=2 must be in \[1, window_batches=2\)"):
        transfer.windowed_matrix(deployment, batch_at, windows=2, window_batches=2, eval_batches=2)


def test_regret_utility_is_zero_without_a_change(deployed):
    run, deployment, batch_of = deployed
    slow = regret.slow_regret(
        run.program,
        run.state.params,
        batch_of,
        [0, 1],
        batch_size=B,
        outer_steps=0,
        learning_rate=1e-3,
        session_length=1,
    )
    for key in ("utility", "low", "high"):
        np.testing.assert_array_equal(slow[key], np.zeros((2, 2)))
    fast = regret.fast_regret(deployment, batch_of, [0, 1], session_length=1, prime_length=0)
    np.testing.assert_array_equal(fast["utility"], np.zeros((2, 2)))
    primed = regret.fast_regret(deployment, batch_of, [0, 1], session_length=1)
    assert np.all(primed["low"] <= primed["utility"]) and np.any(primed["utility"] != 0)


def test_slow_regret_moves_the_learned_initial_states(deployed):
    """The outer steps of slow_regret start from the fresh state of the weights they
    differentiate, so Adam moves the learned initial states (it left them in place when the
    state was built outside the gradient)."""
    run, _, batch_of = deployed
    tx, step = regret.outer_adam(run.program, 1e-2)
    params = run.state.params
    moved, _ = step(params, tx.init(params), run.program.check_batch(batch_of(0, regret.PRIME)))
    initial = lambda p: jax.tree.leaves(nnx.split_state(p, InitialState, ...)[0])
    pairs = zip(initial(moved), initial(params), strict=True)
    changes = [float(np.max(np.abs(a - b))) for a, b in pairs]
    assert changes and min(changes) > 1e-4, changes


def test_long_stream_reports_per_phase(deployed):
    _, deployment, batch_of = deployed
    out = capacity.long_stream(deployment, batch_of, [0, 1], cycles=2, sessions=1, session_length=1)
    assert out["phases"] == [0, 1, 0, 1] and len(out["first_session_loss"]) == 4
    change = out["state_change"][0]["memory"]
    assert change["change_norm"] > 0 and len(change["effective_rank"]) == 1  # Linear: one layer
    assert 1 <= change["effective_rank"][0] <= 8


def test_the_task_switch_measures_the_new_tasks_batch_from_the_old_tasks_state(deployed):
    """``_switch`` measures the first batch of task 1 from the state a batch of task 0 left,
    with its own loss as J and then with a later batch of task 0 as J: the J it gets equal the
    losses of that chain of batches run by hand."""
    run, _, batch_of = deployed
    program, params = run.program, run.state.params
    seen = []

    def measured(p, future=None, on=None, fast=None):
        seen.append(future is not None)
        return float(alignment.program_loss(program, p, on, fast, future)), []

    batches = (report._outer(batch_of(t, HELD_OUT + i)) for t, i in ((0, 0), (1, 0), (0, 1)))
    first, new, old = batches
    start = lambda p: program.start_fast(p, B)  # noqa: E731
    out = report._switch(program, params, (first, new, old), start, measured)
    _, (_, after_first) = program.loss(params, first, program.start_fast(params, B))
    primed = program.start_fast(params, B, after_first)
    own, (_, after_new) = program.loss(params, new, primed)
    later = program.loss(params, old, program.start_fast(params, B, after_new))[0]
    assert seen == [False, True] and set(out) == {"new_task", "old_task"}
    assert out["new_task"]["J"] == pytest.approx(float(own), rel=1e-5)
    assert out["old_task"]["J"] == pytest.approx(float(later), rel=1e-5)
    assert out["old_task"]["J"] != pytest.approx(out["new_task"]["J"], rel=1e-3)


def test_a_task_without_ids_and_a_memory_that_restarts_are_one_line_errors(trained):
    _, run = trained
    mqar = tiny_configs.config("mqar")
    with pytest.raises(ValueError, match="task 'mqar' has no task ids.*windows"):
        task_batches(train.config_lib.build(mqar).task, B)
    sequence = train.config_lib.build(
        tiny_configs.config("continual", levels__memory__persist="sequence")
    )
    with pytest.raises(ValueError, match=r"deployment: no level carries.*persist=stream"):
        Deployment(sequence.program, run.state.params, B)
    settings = report.Settings(protocols=("transfer",))
    bad = run._replace(experiment=sequence)
    with pytest.raises(report.PlasticityError, match=r"--protocols=transfer: no level carries"):
        report.run(bad, settings, explicit=True)


@pytest.mark.slow
def test_plasticity_entry_point_writes_its_json_and_plots(trained):
    workdir, _ = trained
    command = [
        sys.executable,
        str(tiny_configs.ROOT / "experiments" / "plasticity.py"),
        f"--workdir={workdir}",
        "--batch_size=4",
        "--sessions=1",
        "--session_length=1",
        "--eval_batches=1",
        "--cycles=1",
        "--outer_steps=1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((workdir / "plasticity.json").read_text())
    assert set(result) >= {"alignment", "transfer", "regret", "capacity"}
    assert result["alignment"]["trained"]["through_scan"]["levels"]["memory"]["updates"] > 0
    assert result["alignment"]["switch"]["old_task"]["levels"]["memory"]["updates"] > 0
    for name in ("transfer", "alignment", "switch", "regret", "capacity"):
        assert (workdir / f"plasticity_{name}.png").stat().st_size > 0
    assert "alignment memory: cos(grad J, g)" in done.stdout
    assert "switch memory: cos(grad J, -delta)" in done.stdout
    bad = subprocess.run(
        command[:3] + ["--protocols=regret", "--tasks=7"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
        "error: --tasks: [7]"
    )


def test_the_summary_shows_a_level_without_updates_as_n_a():
    """A slow level that made no update in the measured batch has no direction: its cosines
    are None in the JSON, and the printed summary says n/a instead of failing."""
    silent = {"cos_local": None, "conflict_local": None, "cos_update": None, "total_update": 0}
    moved = {"cos_local": 0.25, "conflict_local": 0.5, "cos_update": 0.125, "total_update": 1.5}
    levels = {"memory": moved, "slow": silent}
    result = {
        "alignment": {
            "trained": {"through_scan": {"levels": levels}},
            "initial": {"through_scan": {"levels": levels}},
            "switch": {"old_task": {"levels": levels}, "new_task": {"levels": levels}},
        }
    }
    lines = report.format_summary(result).splitlines()
    assert lines[1] == (
        "alignment slow: cos(grad J, g) n/a trained vs n/a initial; conflict rate n/a; "
        "cos(grad J, -delta) n/a"
    )
    assert lines[0].startswith("alignment memory: cos(grad J, g) 0.250 trained vs 0.250")
    assert lines[3].startswith("switch slow: cos(grad J, -delta) n/a on the new task, n/a")
