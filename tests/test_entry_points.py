"""What a new user meets first, running ``experiments/train.py`` as a user does (a subprocess):
an unusable workdir ends in one line (and a run that fails to build leaves none behind), and a
machine without a TPU is not told so at every run."""

import logging
import subprocess
import sys

import pytest
import tiny_configs

from nested.run import cli

TRAIN = str(tiny_configs.ROOT / "experiments" / "train.py")


def train(*args: str) -> tuple[int, str, list[str]]:
    """Exit status, stdout and the non-blank stderr lines of ``train.py`` on the tiny MQAR
    config with ``args``."""
    done = subprocess.run(
        [sys.executable, TRAIN, *tiny_configs.flags("mqar"), *args],
        cwd=tiny_configs.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout, [line for line in done.stderr.splitlines() if line]


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
def test_unusable_workdir_exits_with_one_line_before_building(tmp_path, where):
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


def test_a_run_that_fails_to_build_leaves_no_workdir(tmp_path):
    workdir = tmp_path / "new" / "run"
    rc, _, lines = train(f"--workdir={workdir}", "--config.model.dim=15")
    assert rc == 1 and len(lines) == 1 and "model.dim=15 is not divisible" in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_no_tpu_note_on_a_machine_without_a_tpu(tmp_path):
    """JAX notes (INFO) that it could not start a TPU backend when it starts its backends; a run
    does not show that. The mesh does not fit the device: the run ends right after the start."""
    rc, out, lines = train(f"--workdir={tmp_path / 'run'}", "--config.train.mesh.data=3")
    assert rc == 1 and out == ""
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: train.mesh.data=3 x train.mesh.model=1 does not fit"), lines


def test_only_the_tpu_note_is_hidden():
    def record(level, message):
        return logging.LogRecord("jax._src.xla_bridge", level, __file__, 1, message, (), None)

    note = "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so"
    assert not cli.not_the_tpu_note(record(logging.INFO, note))
    assert cli.not_the_tpu_note(record(logging.WARNING, note))
    assert cli.not_the_tpu_note(record(logging.INFO, "Unable to initialize backend 'cuda': no"))
