"""The entry points, run as a user runs them: ``python experiments/{train,eval}.py ...``."""

import json
import os
import signal
import time

import pytest
from helpers import tiny_configs

from nested.levels import recipes
from nested.run import metrics, train

ROOT = tiny_configs.ROOT
TRAIN, EVAL = str(ROOT / "experiments" / "train.py"), str(ROOT / "experiments" / "eval.py")


pytestmark = pytest.mark.usefixtures("compilation_cache")  # here and in the subprocesses


def comparable(records):
    return [{k: v for k, v in r.items() if k not in metrics.TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, processes):
    """``experiments/train.py`` on the tiny MQAR config: (workdir, stdout)."""
    workdir = tmp_path_factory.mktemp("cli") / "run"
    done = processes.run(TRAIN, *tiny_configs.flags("mqar"), f"--workdir={workdir}", status=0)
    return workdir, done.stdout


def test_train_entry_point_trains_plots_and_prints_the_final_accuracy(trained):
    workdir, out = trained
    records = metrics.read(workdir)
    final = [r for r in records if r["step"] == 8 and r["split"] != "train"]
    mean = sum(r["accuracy"] for r in final) / len(final)
    assert f"final test accuracy: {mean:.4f} (mean over 2 splits)" in out
    assert f"curves: {workdir / 'curves.png'}" in out
    assert (workdir / "curves.png").exists() and (workdir / "checkpoints" / "8").is_dir()


def test_eval_entry_point_reproduces_the_final_evaluation(trained, processes):
    workdir, _ = trained
    out = processes.run(EVAL, f"--workdir={workdir}", status=0).stdout  # config: the workdir's
    result = json.loads((workdir / "eval.json").read_text())
    final = {
        r["split"]: r for r in metrics.read(workdir) if r["step"] == 8 and r["split"] != "train"
    }
    assert result["step"] == 8 and result["splits"] == final
    assert "final test accuracy" in out


@pytest.mark.slow
def test_eval_sessions_carry_the_memory_across_processes(tmp_path, processes):
    """The flags of a memory session (exact continuation: tests/run/test_checkpoint.py)."""
    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_configs.config("continual"), workdir)
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    processes.run(EVAL, f"--workdir={workdir}", f"--save_memory={m1}", status=0)
    processes.run(
        EVAL, f"--workdir={workdir}", f"--load_memory={m1}", f"--save_memory={m2}", status=0
    )
    lines = (workdir / "sessions.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)  # one line per session
    assert m1.is_dir() and m2.is_dir()
    assert second["splits"] != first["splits"]  # the second session starts from m1's memory


BAD_INPUTS = {
    "typo in an override": (
        ["--config.model.dimm=3"],
        "error: --config.model.dimm: config.model has no key 'dimm'; allowed: "
        "['cms', 'consolidate', ",
    ),
    "unknown rule": (
        ["--config.levels.memory.rule=detla"],
        "error: levels.memory.rule='detla' is unknown; allowed: "
        f"{sorted({*recipes.RULES, *recipes.LEVELS})}",
    ),
    "unknown variant": (
        [f"--config={tiny_configs.path('mqar')}:detla"],
        f"error: --config {tiny_configs.path('mqar')}:detla: variant 'detla' is unknown; "
        f"allowed variants: {sorted({*recipes.RULES, 'hope', 'attention'})}, each also as zoology-",
    ),
    "period not dividing the chunking": (
        ["--config.levels.memory.every=16", "--config.levels.memory.chunk=24"],
        "error: levels.memory.chunk=24 is not a multiple of levels.memory.every=16; "
        "allowed: multiples of 16, e.g. [16, 32, 48, 64]",
    ),
    "dims that do not match": (
        ["--config.model.dim=15"],
        "error: model.dim=15 is not divisible by model.heads=2 (each head's memory is "
        "dim/heads wide unless levels.*.d_k/d_v are set); allowed heads: [1, 3, 5, 15]",
    ),
    "value of the wrong type": (
        ["--config.model.dim=wide"],
        "error: flag --config.model.dim=wide: invalid literal for int() with base 10: 'wide'",
    ),
    "missing config file": (
        ["--config=configs/nope.py"],
        "error: --config configs/nope.py: config file 'configs/nope.py' does not exist",
    ),
    "unknown flag": (["--workdri=x"], "error: Unknown command line flag 'workdri'"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, processes):
    """Every bad-input case started at once (each fails in seconds, before training)."""
    workdir = tmp_path_factory.mktemp("bad")
    started = {}
    for case, (args, _) in BAD_INPUTS.items():
        config = (
            [] if any(a.startswith("--config=") for a in args) else ["--config=configs/mqar.py"]
        )
        started[case] = processes.start(TRAIN, *config, *args, f"--workdir={workdir / 'w'}")
    return started


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_with_one_line_naming_the_key_and_allowed_values(bad_runs, case, processes):
    done = processes.finish(bad_runs[case], timeout=120)
    rc, out, err = done.returncode, done.stdout, done.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 1 and out == ""
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(BAD_INPUTS[case][1]), lines[0]


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_metrics(tmp_path, processes):
    """A real kill (SIGKILL, possibly mid-save) of a CLI run, then the same command again."""
    flags = tiny_configs.flags("mqar", train__steps=200, train__checkpoint_every=20)
    processes.run(TRAIN, *flags, f"--workdir={tmp_path / 'reference'}", status=0)
    killed = tmp_path / "killed"
    process = processes.start(TRAIN, *flags, f"--workdir={killed}")
    while not (killed / "checkpoints" / "40").exists() and process.poll() is None:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    assert metrics.read(killed)[-1]["step"] < 200, "the run ended before it was killed"
    processes.run(TRAIN, *flags, f"--workdir={killed}", status=0)
    assert comparable(metrics.read(killed)) == comparable(metrics.read(tmp_path / "reference"))


@pytest.mark.slow
def test_default_experiment_reaches_ninety_percent(tmp_path, processes):
    """README's first command: the default MQAR experiment (about 2 minutes on 2 cores)."""
    out = processes.run(TRAIN, "--config=configs/mqar.py", f"--workdir={tmp_path}", status=0).stdout
    result = metrics.summary(metrics.read(tmp_path))
    assert result["mean_accuracy"] >= 0.9, out
    assert min(r["accuracy"] for r in result["splits"].values()) >= 0.9, out
    assert (tmp_path / "curves.png").exists()
