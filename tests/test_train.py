"""The training loop: outputs of a run, exact resumption, the non-finite stop, scanned calls."""

import json

import numpy as np
import pytest
import tiny_configs

from nested import guards, metrics, train


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with tiny_configs.compilation_cache(tmp_path_factory):
        yield


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


def _poison_step_3(monkeypatch):
    """Make the program report a non-finite loss at step 3 (as nested.guards flags it)."""
    make = train.make_train_fn

    def poisoned(program):
        run = make(program)

        def call(state, batches):
            state, out = run(state, batches)
            if int(state.step) == 3:
                out = {**out, "loss": out["loss"] * np.nan, "finite/loss": out["finite/loss"] < 0}
                if "skipped" in out:
                    out["skipped"] = out["skipped"] + 1
            return state, out

        return call

    monkeypatch.setattr(train, "make_train_fn", poisoned)


def test_non_finite_loss_stops_the_run_naming_step_and_quantity(tmp_path, monkeypatch):
    _poison_step_3(monkeypatch)
    with pytest.raises(guards.NonFiniteError) as info:
        train.train_and_evaluate(tiny_configs.config("mqar"), tmp_path)
    assert str(info.value).startswith("step 3: non-finite values in the outer loss; the run stop")
    assert [r["step"] for r in metrics.read(tmp_path)] == [2]


def test_skipped_non_finite_steps_are_counted_and_left_out_of_the_means(
    finished, tmp_path, monkeypatch
):
    _poison_step_3(monkeypatch)
    train.train_and_evaluate(tiny_configs.config("mqar", train__skip_nonfinite=True), tmp_path)
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
