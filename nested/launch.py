"""Start the processes of a multi-process run on this machine, on loopback::

    python -m nested.launch --num_processes 2 [--devices_per_process 2] -- \\
        experiments/train.py --config configs/mqar.py --workdir runs/mqar2

runs the command once per process, adding ``--coordinator_address=127.0.0.1:<free port>
--num_processes=N --process_id=I`` (:mod:`nested.run.distributed`), each in its own session so
that only the launcher forwards signals: SIGTERM and SIGINT go to every process (a training run
then checkpoints and exits 128 + the signal: 143, or 130 for Ctrl-C). ``--devices_per_process
K`` gives each process K simulated CPU devices (XLA's
``--xla_force_host_platform_device_count``), the way tests and benchmarks run a multi-host
layout on one machine.

When a process ends with a non-zero status while others still run, the others get
``--grace_seconds`` to stop by themselves (a run's processes notice a lost peer and say which);
then they are terminated, killed 10 s later if need be. The launcher's exit status is the worst
of the processes' (a process ended by signal S counts as 128 + S, as a shell reports it).

On a real cluster the launcher is not needed: SLURM (``srun``) or a TPU pod starts one process
per host with the environment JAX reads, and the same command line takes ``--distributed``;
or pass the three flags yourself on each host.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import app, flags

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes to start (>= 1).")
_DEVICES = flags.DEFINE_integer(
    "devices_per_process", 0, "Simulated CPU devices per process (0: as XLA_FLAGS says)."
)
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0: a free one).")
_GRACE = flags.DEFINE_float(
    "grace_seconds", 60.0, "After a process fails, how long the others get to stop themselves."
)
flags.mark_flag_as_required("num_processes")

KILL_AFTER = 10.0  # seconds between terminating the remaining processes and killing them


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_status(returncode: int) -> int:
    """A process's status as a shell reports it: 128 + S for a process ended by signal S."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"{exit_status(returncode)} ({signal.Signals(-returncode).name})"
    return str(returncode)


def commands(command: Sequence[str], count: int, port: int) -> list[list[str]]:
    """The command line of every process: ``command`` (a ``.py`` file runs with this Python)
    and the three flags of :mod:`nested.run.distributed`."""
    base = [sys.executable, *command] if command[0].endswith(".py") else list(command)
    address = f"--coordinator_address=127.0.0.1:{port}"
    return [[*base, address, f"--num_processes={count}", f"--process_id={i}"] for i in range(count)]


def environment(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    if devices:
        kept = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
    return env


def launch(
    command: Sequence[str],
    count: int,
    *,
    devices: int = 0,
    port: int = 0,
    grace: float = 60.0,
) -> int:
    """Run ``command`` as ``count`` processes of one run (see the module docstring); return
    the worst exit status."""
    env = environment(devices)
    procs = [
        subprocess.Popen(line, env=env, start_new_session=True)
        for line in commands(command, count, port or free_port())
    ]

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed_at = terminated_at = None
    try:
        while [proc.poll() for proc in procs].count(None):  # poll every one
            now = time.monotonic()
            for i, proc in enumerate(procs):
                if proc.returncode and failed_at is None:
                    failed_at = now
                    print(
                        f"launch: process {i} exited with status {describe(proc.returncode)}; "
                        f"the others get {grace:g} s to stop",
                        file=sys.stderr,
                        flush=True,
                    )
            if failed_at is not None and terminated_at is None and now - failed_at > grace:
                terminated_at = now
                forward(signal.SIGTERM, None)
            if terminated_at is not None and now - terminated_at > KILL_AFTER:
                forward(signal.SIGKILL, None)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for i, proc in enumerate(procs):
        if proc.returncode:
            print(f"launch: process {i}: status {describe(proc.returncode)}", file=sys.stderr)
    return max(exit_status(proc.returncode) for proc in procs)


def main(argv: Sequence[str]) -> int:
    command = list(argv[1:])
    if not command:
        sys.exit("error: give the program to run after --, e.g. -- experiments/train.py ...")
    if _NUM_PROCESSES.value < 1:
        sys.exit(f"error: --num_processes={_NUM_PROCESSES.value} must be at least 1")
    if _DEVICES.value < 0:
        sys.exit(f"error: --devices_per_process={_DEVICES.value} must be >= 0")
    return launch(
        command,
        _NUM_PROCESSES.value,
        devices=_DEVICES.value,
        port=_PORT.value,
        grace=_GRACE.value,
    )


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
