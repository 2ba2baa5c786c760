"""One run across processes (``jax.distributed`` on loopback, gloo collectives): real processes
of ``experiments/train.py``, started by ``python -m nested.launch`` or by hand, bounded in time.

Tolerances. 2 processes x 2 devices split each batch four ways like 1 process x 4 devices; only
the cross-device sums of the gradients differ in order (gloo's all-reduce between processes,
XLA's inside one), a few float32 roundings (6e-8 relative each) a step, carried through 8
Adam steps: in the runs these tests were written from, the 2 x 2 and 1 x 4 losses differed by
at most 1.2e-7 (4.5e-8 relative), and the tests allow 1e-5. One device sums all rows in one
reduction instead of four partial sums, so the gap to it is the same kind (at most 2.4e-7
then), allowed 1e-4.
"""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import tiny_configs

from nested import launch
from nested.run import distributed, metrics

ROOT = tiny_configs.ROOT
TRAIN = str(ROOT / "experiments" / "train.py")
EVAL = str(ROOT / "experiments" / "eval.py")
SAME_SPLIT, ONE_DEVICE = 1e-5, 1e-4  # relative tolerances (module docstring)


def command(workdir, processes, devices, *extra):
    """The command line training the tiny MQAR config in ``workdir`` on ``processes`` x
    ``devices`` (through the launcher when there are several processes), logging every step."""
    flags = tiny_configs.flags("mqar", train__log_every=1)
    train = [TRAIN, *flags, f"--workdir={workdir}", *extra]
    if processes == 1:
        return [sys.executable, *train]
    launcher = [f"--num_processes={processes}", f"--devices_per_process={devices}"]
    return [sys.executable, "-m", "nested.launch", *launcher, "--", *train]


def popen(line, **options):
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(line, cwd=ROOT, **{**pipes, **options})


def start(workdir, processes, devices, *extra):
    return popen(command(workdir, processes, devices, *extra), env=launch.environment(devices))


def losses(workdir):
    """``{(step, split): loss}`` of a run's records."""
    return {(r["step"], r["split"]): r["loss"] for r in metrics.read(workdir)}


def assert_same_losses(a, b, rtol):
    a, b = losses(a), losses(b)
    assert sorted(a) == sorted(b)
    keys = sorted(a)
    np.testing.assert_allclose([a[k] for k in keys], [b[k] for k in keys], rtol=rtol)


def srun_style(workdir, devices, *extra):
    """The two processes of a run started as SLURM's ``srun`` starts them: ``--distributed``
    and the variables ``srun`` sets (here for one node, loopback), which JAX reads."""
    line, port = [*command(workdir, 1, devices, *extra), "--distributed"], launch.free_port()
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2"}
    env = {**launch.environment(devices), **slurm, "JAX_COORDINATOR_PORT": str(port)}
    tasks = [{"SLURM_PROCID": f"{i}", "SLURM_LOCALID": f"{i}"} for i in (0, 1)]
    return [popen(line, env={**env, **task}) for task in tasks]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, processes):
    """The tiny MQAR run on 2 processes x 2 devices (started as ``srun`` starts them; the
    launcher's runs are in the slow tests), 1 x 4 and 1 x 1, side by side."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    layouts = {"one_by_four": (1, 4), "one_by_one": (1, 1)}
    started = {name: [start(tmp / name, *layout)] for name, layout in layouts.items()}
    started["two_by_two"] = srun_style(tmp / "two_by_two", 2)
    done = {name: [processes.finish(p) for p in group] for name, group in started.items()}
    for name, results in done.items():
        for result in results:
            assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return {"tmp": tmp, **{name: tmp / name for name in started}, "logs": done}


@pytest.mark.slow
def test_two_processes_train_like_one_process_and_resume_on_one(runs, processes):
    assert_same_losses(runs["two_by_two"], runs["one_by_four"], SAME_SPLIT)
    assert_same_losses(runs["two_by_two"], runs["one_by_one"], ONE_DEVICE)
    # Process 0 alone writes the records, once each; the others' log lines say who they are.
    records = metrics.read(runs["two_by_two"])
    assert len(records) == len({(r["step"], r["split"]) for r in records}) == 8 + 2 * 2
    assert (runs["two_by_two"] / "curves.png").exists()
    (out0, err0), (out1, err1) = ((r.stdout, r.stderr) for r in runs["logs"]["two_by_two"])
    assert "over 4 cpu device(s) of 2 processes" in err0 and "[process 1/2] step 8/8" in err1
    assert "final evaluation at step 8" in out0 and "final evaluation" not in out1
    # 2 processes -> 1: the checkpoint of step 4 continues on one process, one device.
    copy = tiny_configs.resumable_copy(runs["two_by_two"], runs["tmp"] / "two_then_one")
    err = processes.finish(start(copy, 1, 1), status=0).stderr
    assert "resumed from the checkpoint of step 4" in err
    assert_same_losses(copy, runs["two_by_two"], ONE_DEVICE)


@pytest.mark.slow
def test_one_process_resumes_on_two_and_two_evaluate(runs, processes):
    copy = tiny_configs.resumable_copy(runs["one_by_one"], runs["tmp"] / "one_then_two")
    err = processes.finish(start(copy, 2, 2), status=0).stderr
    assert "resumed from the checkpoint of step 4" in err
    assert_same_losses(copy, runs["one_by_one"], ONE_DEVICE)
    # eval.py takes the same flags: its results are the run's final evaluation.
    line = ["--num_processes=2", "--devices_per_process=2", "--", EVAL, f"--workdir={copy}"]
    out = processes.finish(popen([sys.executable, "-m", "nested.launch", *line]), status=0).stdout
    assert out.count("final evaluation at step 8") == 1
    evaluated = json.loads((copy / "eval.json").read_text())["splits"]
    final = metrics.final_eval(metrics.read(copy))
    for split, record in final.items():
        np.testing.assert_allclose(evaluated[split]["loss"], record["loss"], rtol=SAME_SPLIT)
        assert evaluated[split]["accuracy"] == record["accuracy"]


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def checkpoint_steps(workdir):
    folder = workdir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


@pytest.mark.slow
def test_a_lost_process_stops_the_other_and_a_relaunch_resumes_exactly(tmp_path, processes):
    """SIGKILL of process 1: process 0 names it and exits 1 within 60 s. The relaunch resumes
    from the last complete checkpoint; a SIGTERM to every process then saves once and exits
    143; the last relaunch ends with the uninterrupted run's metrics."""
    longer = ["--config.train.steps=200", "--config.train.eval_every=100"]
    reference = start(tmp_path / "reference", 1, 4, *longer)
    workdir, port = tmp_path / "run", launch.free_port()
    lines = launch.commands(command(workdir, 1, 2, *longer)[1:], 2, port)
    env = launch.environment(2)
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    pairs = zip(lines, logs, strict=True)
    procs = [popen(line, env=env, stdout=log, stderr=log) for line, log in pairs]
    wait_for(lambda: max(checkpoint_steps(workdir), default=0) >= 8, 180, "a checkpoint")
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    rc = procs[0].wait(timeout=90)
    assert time.monotonic() - killed < 60
    procs[1].wait()
    logs[0].seek(0)
    assert rc == 1 and "error: process 1 of 2 stopped responding" in logs[0].read()

    relaunched = start(workdir, 2, 2, *longer)
    resumed_from = max(checkpoint_steps(workdir))
    wait_for(lambda: max(checkpoint_steps(workdir)) > resumed_from + 4, 180, "progress")
    relaunched.send_signal(signal.SIGTERM)  # the launcher forwards it to both
    err = processes.finish(relaunched, status=143).stderr
    assert err.count("stopped by SIGTERM at step") == 2  # each process says so
    stopped = int(err.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert max(checkpoint_steps(workdir)) == stopped
    assert f"resumed from the checkpoint of step {resumed_from}" in err

    err = processes.finish(start(workdir, 2, 2, *longer), status=0).stderr
    assert f"resumed from the checkpoint of step {stopped}" in err
    processes.finish(reference, status=0)
    assert_same_losses(workdir, tmp_path / "reference", SAME_SPLIT)


@pytest.mark.slow
def test_bad_settings_fail_in_one_line_before_jax_starts(tmp_path, processes):
    bad = {
        "--process_id=2 is out of range for --num_processes=2; use 0..1": dict(process_id=2),
        "--num_processes=0 must be at least 1": dict(num_processes=0),
        "--coordinator_address='localhost' must be HOST:PORT": dict(
            coordinator_address="localhost"
        ),
    }
    for message, change in bad.items():
        fields = {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 0}
        settings = distributed.Settings(**{**fields, **change})
        with pytest.raises(distributed.DistributedError, match=re.escape(message)):
            distributed.check(settings)
    with pytest.raises(distributed.DistributedError, match="--process_id missing"):
        distributed.check(distributed.Settings(coordinator_address="127.0.0.1:1", num_processes=2))
    # The entry point: one line, exit status 1.
    flags = ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=5"]
    line = [sys.executable, TRAIN, *tiny_configs.flags("mqar"), f"--workdir={tmp_path}", *flags]
    err = processes.finish(popen(line), status=1).stderr
    assert err.strip() == "error: --process_id=5 is out of range for --num_processes=2; use 0..1"
    # --distributed where no cluster environment says who the processes are.
    line = [*line[: -len(flags)], "--distributed"]
    err = processes.finish(popen(line), status=1).stderr
    assert err.startswith("error: --distributed: ") and len(err.strip().splitlines()) == 1


def test_an_unreachable_coordinator_fails_within_the_timeout():
    settings = distributed.Settings(
        coordinator_address=f"127.0.0.1:{launch.free_port()}",
        num_processes=2,
        process_id=1,
        timeout=2,
    )
    began = time.monotonic()
    with pytest.raises(distributed.DistributedError, match="no coordinator answered within"):
        distributed.initialize(settings)
    assert 2 <= time.monotonic() - began < 10


@pytest.mark.parametrize(
    ("host", "bind"), [("127.0.0.1", "127.0.0.1"), ("localhost", "localhost"), ("10.0.0.7", None)]
)
def test_a_loopback_coordinator_listens_on_loopback_only(monkeypatch, host, bind):
    """The coordinator binds to the loopback address it is given (not every interface); a
    cluster address keeps JAX's default, reachable from the other hosts."""
    calls = []
    monkeypatch.setattr(distributed, "_check_bindable", lambda *args: None)
    monkeypatch.setattr(distributed, "_tag_logs", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    port = launch.free_port()
    settings = distributed.Settings(
        coordinator_address=f"{host}:{port}", num_processes=2, process_id=0
    )
    distributed.initialize(settings)
    expected = None if bind is None else f"{bind}:{port}"
    assert calls[0].get("coordinator_bind_address") == expected


@pytest.mark.slow
def test_processes_started_with_different_configs_are_refused(tmp_path, processes):
    lines = launch.commands(command(tmp_path / "run", 1, 1)[1:], 2, launch.free_port())
    lines[1].append("--config.model.dim=32")
    env = launch.environment(1)
    for done in [processes.finish(p, status=1) for p in [popen(line, env=env) for line in lines]]:
        assert done.stderr.strip().splitlines()[-1] == (
            "error: process(es) [1] of 2 were started with another config or --workdir than "
            "process 0; start every process with the same command line (only the process "
            "flags differ)"
        )


@pytest.mark.slow
def test_a_batch_the_devices_of_all_processes_do_not_divide_is_refused(tmp_path, processes):
    started = start(tmp_path / "run", 2, 2, "--config.train.batch_size=6")
    err = processes.finish(started, status=1).stderr
    assert (
        "train.batch_size=6 is not divisible by the 4 devices (data=4 x fsdp=1) the batch is "
        "split over; use a multiple of 4 (data=4 x fsdp=1 x tensor=1 over 4 cpu device(s) of 2 "
        "processes)"
    ) in err


FAKE = """
import os, signal, sys, time
me = int([a for a in sys.argv if a.startswith("--process_id=")][0].split("=")[1])
mode = sys.argv[1]
if mode == "statuses":
    sys.exit([0, 3][me])
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.write(1, b"ready\\n")  # one write: the two processes' lines never interleave
    time.sleep(60)
if mode == "one_fails":
    if me == 0:
        sys.exit(2)
    time.sleep(60)
"""


def test_the_launcher_forwards_signals_and_returns_the_worst_status(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    assert launch.launch([str(script), "statuses"], 2) == 3
    # A process that fails leaves the others `grace` seconds, then they are terminated.
    began = time.monotonic()
    assert launch.launch([str(script), "one_fails"], 2, grace=0.5) == 128 + signal.SIGTERM
    assert time.monotonic() - began < 30
    # SIGTERM to the launcher reaches every process.
    run = popen(
        [sys.executable, "-m", "nested.launch", "--num_processes=2", "--", str(script), "term"],
        stderr=None,
    )
    assert run.stdout.readline() == "ready\n" and run.stdout.readline() == "ready\n"
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 143
    # Every process gets the three flags, the coordinator on loopback.
    lines = launch.commands(["x.py", "--a=1"], 2, 1234)
    assert lines[1][1:] == [
        "x.py",
        "--a=1",
        "--coordinator_address=127.0.0.1:1234",
        "--num_processes=2",
        "--process_id=1",
    ]
    flags = launch.environment(3)["XLA_FLAGS"].split()
    assert [f for f in flags if "device_count" in f] == ["--xla_force_host_platform_device_count=3"]
