"""Training processes killed (SIGKILL) at random points, during checkpoint saves too, and
stopped by SIGTERM, resume to exactly the metrics of an uninterrupted run.

Each run is a real process (a small driver around ``nested.run.train.train_and_evaluate`` and
``nested.run.cli.user_errors``, as ``experiments/train.py`` runs it). To make a kill during a save
certain rather than lucky, the driver can slow down the last step of every orbax save (the
atomic rename of the finished temporary folder) by ``delay`` seconds: a save then shows a
``<step>.orbax-checkpoint-tmp`` folder for that long, and the test kills the process while
it is there. The driver prints ``RESTORED <step>`` (the checkpoint it resumed from) and
``STEP <n>`` per training log record, which the test reads to time its signals.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import tiny_configs

from nested.data import corpus
from nested.run import metrics

TMP = ".orbax-checkpoint-tmp"
COMMITTED = "commit_success.txt"  # orbax writes it into a step folder before the rename

DRIVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from orbax.checkpoint._src.path import atomicity
    from helpers import tiny_configs
    from nested.run import checkpoint, cli, metrics, train

    workdir, delay, overrides = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
    name = sys.argv[4]
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow_finalize(self, *args, **kwargs):
        await asyncio.sleep(delay)
        return await finalize(self, *args, **kwargs)

    if delay:
        atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
    restore, write = checkpoint.Checkpointer.restore_latest, metrics.MetricWriter.write

    def reported_restore(self, like):
        restored = restore(self, like)
        print("RESTORED", None if restored is None else restored.step, flush=True)
        return restored

    def reported_write(self, step, split, values):
        record = write(self, step, split, values)
        if split == metrics.TRAIN:
            print("STEP", step, flush=True)
        return record

    checkpoint.Checkpointer.restore_latest = reported_restore
    metrics.MetricWriter.write = reported_write
    with cli.user_errors():
        train.train_and_evaluate(tiny_configs.config(name, **overrides), workdir)
    """
)


@pytest.fixture(scope="module")
def env(compilation_cache):
    return {**os.environ, "JAX_PLATFORMS": "cpu"}  # with the cache's variables


class Run:
    """One training process; its stdout and stderr go to files (read while it runs)."""

    count = 0

    def __init__(self, workdir, env, *, delay=0.0, config="mqar", **overrides):
        Run.count += 1
        self.out = workdir.parent / f"{workdir.name}.{Run.count}.out"
        self.err = workdir.parent / f"{workdir.name}.{Run.count}.err"
        args = [str(workdir), str(delay), json.dumps(overrides), config]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-c", DRIVER, *args], stdout=out, stderr=err, env=env
            )

    def lines(self, tag: str) -> list[str]:
        """The values of the finished ``<tag> <value>`` lines printed so far."""
        finished = self.out.read_text().split("\n")[:-1]
        return [line.split()[1] for line in finished if line.startswith(f"{tag} ")]

    def restored(self) -> int | None:
        (step,) = self.lines("RESTORED")
        return None if step == "None" else int(step)

    def wait_for(self, condition, timeout=300.0) -> bool:
        """Poll ``condition`` every few ms; False if the process ended first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                return True
            if self.process.poll() is not None:
                return condition()
            time.sleep(0.005)
        raise TimeoutError(self.err.read_text()[-3000:])

    def signal(self, signum) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=300)

    def finish(self) -> int:
        rc = self.process.wait(timeout=600)
        assert rc == 0, self.err.read_text()[-3000:]
        return rc


def folders(workdir) -> list[str]:
    directory = workdir / "checkpoints"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def saving(workdir) -> list[str]:
    return [name for name in folders(workdir) if name.endswith(TMP)]


def complete_steps(workdir) -> list[int]:
    """Steps whose folder holds a finished save. (A kill can leave one other kind of step
    folder: the oldest checkpoint, half deleted after a newer one was saved.)"""
    directory = workdir / "checkpoints"
    names = [n for n in folders(workdir) if n.isdigit() and (directory / n / COMMITTED).exists()]
    return sorted(int(name) for name in names)


def comparable(records):
    return [{k: v for k, v in r.items() if k not in metrics.TIMING_KEYS} for r in records]


SHORT = {"train__steps": 12}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    workdir = tmp_path_factory.mktemp("reference") / "run"
    Run(workdir, env, **SHORT).finish()
    return comparable(metrics.read(workdir))


@pytest.mark.slow
def test_killed_mid_save_then_stopped_by_sigterm_resumes_to_the_same_metrics(
    tmp_path, env, reference
):
    workdir = tmp_path / "run"
    # 1. SIGKILL while the first checkpoint (step 4) is being written
    run = Run(workdir, env, delay=0.5, **SHORT)
    assert run.wait_for(lambda: saving(workdir)), "the run ended before its first save"
    run.signal(signal.SIGKILL)
    assert saving(workdir) == [f"4{TMP}"] and complete_steps(workdir) == []

    # 2. restart (from scratch: nothing was saved), then SIGTERM once step 6 is logged
    run = Run(workdir, env, delay=0.5, **SHORT)
    assert run.wait_for(lambda: "6" in run.lines("STEP"))
    assert run.signal(signal.SIGTERM) == 128 + signal.SIGTERM
    assert run.restored() is None
    message = run.err.read_text().strip().splitlines()[-1]
    stopped = int(message.split()[5].rstrip(":"))
    assert message == (
        f"stopped by SIGTERM at step {stopped}: its checkpoint is in {workdir / 'checkpoints'}; "
        f"run the same command to resume from step {stopped}"
    )
    assert 6 <= stopped < 12 and stopped in complete_steps(workdir)
    assert saving(workdir) == []  # the stop waited for its save

    # 3. the same command again: resumes from the stop, ends as the uninterrupted run
    run = Run(workdir, env, **SHORT)
    run.finish()
    assert run.restored() == stopped
    assert comparable(metrics.read(workdir)) == reference
    assert not [name for name in folders(workdir) if not name.isdigit()]  # nothing left over


@pytest.mark.slow
@pytest.mark.parametrize("n_kills", [4, 8])
def test_random_sigkills_end_with_the_uninterrupted_metrics(tmp_path, env, n_kills):
    """SIGKILLs at random points (startup, compilation, restore, training, mid-save), each
    followed by the same command; then one uninterrupted run to compare with."""
    settings = {"train__steps": 60, "train__keep_checkpoints": 2}
    rng = random.Random(0)
    workdir = tmp_path / "killed"
    kills = {"mid_save": 0, "random_time": 0, "after_step": 0}
    newest = None  # the newest finished save when the last process was killed
    for i in range(n_kills):
        mode = ["mid_save", "random_time", "after_step"][i % 3]
        run = Run(workdir, env, delay=0.2, **settings)
        if mode == "mid_save":  # once restored, every temporary folder is this process's
            run.wait_for(lambda: run.lines("RESTORED") and saving(workdir))
        elif mode == "random_time":  # often during startup, compilation or the restore
            time.sleep(rng.uniform(0.0, 5.0))
        else:
            target = str(min((newest or 0) + rng.choice([6, 8, 10, 12]), 60))
            run.wait_for(lambda target=target: target in run.lines("STEP"))
        alive = run.process.poll() is None
        run.signal(signal.SIGKILL)
        kills[mode] += alive and (mode != "mid_save" or bool(saving(workdir)))
        restored = run.lines("RESTORED")
        if restored:  # it got as far as restoring: the newest finished save, never another
            assert restored == [str(newest)], (restored, newest)
        steps = complete_steps(workdir)
        newest = steps[-1] if steps else None
    landed = sum(kills.values())  # kills that hit a live process (mid-save: during a save)
    assert kills["mid_save"] == len(range(0, n_kills, 3)) and landed >= n_kills - 2, kills
    run = Run(workdir, env, **settings)
    run.finish()
    assert run.restored() == newest

    reference = tmp_path / "reference"
    Run(reference, env, **settings).finish()
    assert comparable(metrics.read(workdir)) == comparable(metrics.read(reference))


@pytest.mark.slow
def test_ctrl_c_during_a_save_keeps_it_and_the_run_resumes_to_the_same_metrics(
    tmp_path, env, reference
):
    """SIGINT (Ctrl-C) while the first checkpoint is being written: the save completes, the
    run saves the step it reaches, exits 130 naming the step a resume starts from, and the
    same command then ends as the uninterrupted run."""
    workdir = tmp_path / "run"
    run = Run(workdir, env, delay=0.5, **SHORT)
    assert run.wait_for(lambda: saving(workdir)), "the run ended before its first save"
    assert run.signal(signal.SIGINT) == 128 + signal.SIGINT
    message = run.err.read_text().strip().splitlines()[-1]
    stopped = int(message.split()[5].rstrip(":"))
    assert message == (
        f"stopped by SIGINT at step {stopped}: its checkpoint is in {workdir / 'checkpoints'}; "
        f"run the same command to resume from step {stopped}"
    )
    assert 4 in complete_steps(workdir) and stopped in complete_steps(workdir)
    assert saving(workdir) == []
    run = Run(workdir, env, **SHORT)
    run.finish()
    assert run.restored() == stopped
    assert comparable(metrics.read(workdir)) == reference


@pytest.mark.slow
def test_a_second_run_on_a_workdir_in_use_is_refused_in_one_line(tmp_path, env):
    """Two training processes on one workdir: the second stops before writing anything,
    naming the first's pid and host; once the first has ended, the workdir is free."""
    workdir = tmp_path / "run"
    first = Run(workdir, env, train__steps=400)
    assert first.wait_for(lambda: first.lines("STEP"))
    second = Run(workdir, env, train__steps=400)
    assert second.process.wait(timeout=300) == 1
    message = second.err.read_text().strip().splitlines()[-1]
    assert message.startswith(f"error: workdir {workdir} is in use by pid {first.process.pid} ")
    assert "wait for that run to end, stop it, or train in another --workdir" in message
    assert second.lines("STEP") == [] and first.process.poll() is None
    assert first.signal(signal.SIGTERM) == 128 + signal.SIGTERM
    stopped = int(first.err.read_text().strip().splitlines()[-1].split()[5].rstrip(":"))
    third = Run(workdir, env, train__steps=stopped)
    third.finish()
    assert third.restored() == stopped


@pytest.mark.slow
def test_a_token_corpus_run_killed_resumes_to_the_batches_of_an_uninterrupted_one(tmp_path, env):
    """The token loader's position is in the checkpoint: a run on a prepared corpus SIGKILLed
    after its first checkpoint and run again logs what an uninterrupted run logs."""
    data = tmp_path / "text"
    data.mkdir()
    for i, path in enumerate(sorted((tiny_configs.ROOT / "nested" / "core").glob("*.py"))):
        (data / f"{i}.txt").write_text(path.read_text())
    folder = tmp_path / "corpus"
    corpus.prepare([str(data)], str(folder), val_fraction=0.2)
    settings = {"task__path": str(folder), "train__steps": 24}
    reference = tmp_path / "reference"
    Run(reference, env, config="lm", **settings).finish()
    workdir = tmp_path / "killed"
    run = Run(workdir, env, config="lm", **settings)
    assert run.wait_for(lambda: "6" in run.lines("STEP") and 4 in complete_steps(workdir))
    run.signal(signal.SIGKILL)
    killed_after = int(run.lines("STEP")[-1])
    assert killed_after < 24, "the run ended before the kill"
    run = Run(workdir, env, config="lm", **settings)
    run.finish()
    assert 4 <= run.restored() <= killed_after
    assert comparable(metrics.read(workdir)) == comparable(metrics.read(reference))
