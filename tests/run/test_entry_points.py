"""What a new user meets first, running ``experiments/train.py`` and ``eval.py`` as a user
does (a subprocess): an unusable workdir ends in one line (and a run that fails to build leaves
none behind), a machine without a TPU is not told so at every run, a rule of one's own is
found in the current folder, and a run evaluates with overrides but no config file."""

import logging

import pytest
from helpers import tiny_configs

from nested.run import cli, rundir
from nested.run import config as nc

TRAIN = str(tiny_configs.ROOT / "experiments" / "train.py")
EVAL = str(tiny_configs.ROOT / "experiments" / "eval.py")


@pytest.fixture
def run(processes):
    """``run(script, *args, cwd=ROOT)``: the exit status, stdout and the non-blank stderr lines
    of ``script`` with ``args``."""

    def run(script: str, *args: str, cwd=tiny_configs.ROOT) -> tuple[int, str, list[str]]:
        done = processes.run(script, *args, cwd=cwd, timeout=120)
        return done.returncode, done.stdout, processes.stderr_lines(done)

    return run


@pytest.fixture
def train(run):
    """``train(*args, cwd=ROOT)``: :func:`run` of ``train.py`` on the tiny MQAR config."""
    return lambda *args, cwd=tiny_configs.ROOT: run(
        TRAIN, *tiny_configs.flags("mqar"), *args, cwd=cwd
    )


@pytest.mark.parametrize(
    "where", ["under a file", pytest.param("under /proc", marks=pytest.mark.slow)]
)
def test_unusable_workdir_exits_with_one_line_before_building(tmp_path, where, train):
    if where == "under a file":
        (tmp_path / "file").write_text("")
        workdir = tmp_path / "file" / "run"
    else:
        workdir = "/proc/nested-test/run"
    # model.dim=15 does not build (heads=2): the workdir's error comes first.
    rc, out, lines = train(f"--workdir={workdir}", "--config.model.dim=15")
    assert rc == 1 and out == ""
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: workdir {workdir} cannot be created or written to ("), lines
    assert lines[0].endswith("; pass a folder you can write to (new or of this run)"), lines


def test_a_run_that_fails_to_build_leaves_no_workdir(tmp_path, train):
    workdir = tmp_path / "new" / "run"
    rc, _, lines = train(f"--workdir={workdir}", "--config.model.dim=15")
    assert rc == 1 and len(lines) == 1 and "model.dim=15 is not divisible" in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_no_tpu_note_on_a_machine_without_a_tpu(tmp_path, train):
    """JAX notes (INFO) that it could not start a TPU backend when it starts its backends; a run
    does not show that. The mesh does not fit the device: the run ends right after the start."""
    rc, out, lines = train(f"--workdir={tmp_path / 'run'}", "--config.train.mesh.data=3")
    assert rc == 1 and out == ""
    assert len(lines) == 1, lines
    assert lines[0] == (
        "error: train.mesh.data=3 x train.mesh.fsdp=1 x train.mesh.tensor=1 does not fit the 1 "
        "cpu device(s): the sizes must multiply to 1 (-1: the devices the other axes leave)"
    ), lines


def test_only_the_tpu_note_is_hidden():
    def record(level, message):
        return logging.LogRecord("jax._src.xla_bridge", level, __file__, 1, message, (), None)

    note = "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so"
    assert not cli.not_the_tpu_note(record(logging.INFO, note))
    assert cli.not_the_tpu_note(record(logging.WARNING, note))
    assert cli.not_the_tpu_note(record(logging.INFO, "Unable to initialize backend 'cuda': no"))


def test_a_rule_of_ones_own_is_imported_from_the_current_folder(tmp_path, train):
    """``--config.levels.memory.rule=my_rules:...`` beside the user: the module is found (here
    the function is misspelt, so the run ends before compiling, naming what there is)."""
    (tmp_path / "my_rules.py").write_text("def huber_sign(name, *, d_k, d_v, **kwargs): ...\n")
    rule = "--config.levels.memory.rule=my_rules:huber_sing"
    rc, out, lines = train(f"--workdir={tmp_path / 'run'}", rule, cwd=tmp_path)
    assert rc == 1 and out == ""
    assert lines == [
        "error: levels.memory.rule='my_rules:huber_sing': module my_rules has no function "
        "'huber_sing'; allowed: ['huber_sign']"
    ]


def test_eval_overrides_apply_to_the_runs_config_without_the_config_file(tmp_path, run):
    """``eval.py --workdir=DIR --config.task.<key>=...``: the override reaches the run's
    config (here a setting too short for the task, refused before anything is compiled: the
    run needs no checkpoint for that); one of the model is refused (tests/run/test_train.py
    evaluates a run with overrides)."""
    (tmp_path / "checkpoints").mkdir()
    rundir.record_config(tiny_configs.config("mqar"), tmp_path, 0)
    rc, out, lines = run(EVAL, f"--workdir={tmp_path}", "--config.task.test_settings=((8, 4),)")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: task: mqar: test_settings.seq_len=8 is invalid"), lines
    with pytest.raises(nc.ConfigError) as info:
        cli.workdir_config(str(tmp_path), ["--config.model.dim=8"])
    assert str(info.value) == (
        "--config.model.dim: evaluating --workdir's run keeps its model; overrides may change "
        "['task.*', 'train.*'] (or pass --config, a config file)"
    )


@pytest.mark.parametrize(
    "script",
    ["train.py"]  # the others with -m slow: each --help starts a process
    + [
        pytest.param(s, marks=pytest.mark.slow)
        for s in ("eval.py", "serve.py", "prepare.py", "eval_lm.py")
    ],
)
def test_help_prints_the_flags_and_exits_0(script, run):
    status, out, _ = run(str(tiny_configs.ROOT / "experiments" / script), "--help")
    assert status == 0 and "--helpfull" in out and "flags:" in out


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_one_line_and_the_run_resumes(tmp_path, train):
    """Every data file of the last checkpoint cut in half: the resumed run says so in one
    line, without the tracebacks of orbax's abandoned reads into their closed event loop."""
    workdir = tmp_path / "run"
    rc, _, _ = train(f"--workdir={workdir}")
    assert rc == 0
    for path in (workdir / "checkpoints" / "8" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    rc, _, lines = train(f"--workdir={workdir}", "--config.train.steps=12")
    assert rc == 0, lines[-5:]
    damaged = [line for line in lines if "checkpoint step 8 is damaged" in line]
    assert len(damaged) == 1, lines
    noise = [i for i, line in enumerate(lines) if "Event loop" in line or "Traceback" in line]
    assert not noise, "\n".join(lines[max(0, noise[0] - 3) : noise[0] + 30])
