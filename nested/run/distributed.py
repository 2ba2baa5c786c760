"""Several processes, one run: JAX's multi-controller runtime for training and evaluation.

A multi-host run is one process per host (on this machine, several processes on loopback),
each started with the same command line plus where to meet and who it is::

    --coordinator_address=HOST:PORT --num_processes=N --process_id=I

or ``--distributed`` alone, where the cluster's launcher set the environment that
``jax.distributed.initialize()`` reads by itself (SLURM, Open MPI, Kubernetes, a TPU pod).
:func:`initialize` joins the processes before anything else touches JAX; from then on
``jax.devices()`` lists every process's devices, the run's mesh spans them all
(:mod:`nested.run.sharding`), each process feeds only its own rows of every global batch
(:meth:`nested.run.sharding.Layout.rows`), and XLA's collectives (gloo on CPU) do the rest.
The training loop itself is the single-process one; only process 0 writes the run's files.

What a cluster user expects when something goes wrong:

* **Bad flags** (a process id out of range, an address without a port) are refused before
  JAX starts, in one line (:class:`DistributedError`).
* **Processes started differently** (another config or workdir on one host) are refused on
  every process, naming the ones that differ (:func:`check_same`, before anything compiles).
* **An unreachable coordinator** (process 0 not started, a wrong address) fails after
  ``timeout`` seconds with one line, instead of JAX's abort with a stack trace.
* **A lost process**: every process beats a counter in the coordination service's key-value
  store (:class:`Watchdog`); when a peer's counter stops for ``heartbeat`` seconds (killed,
  crashed, hung) the others print which one and exit with status 1, instead of waiting in a
  collective forever. Relaunching every process resumes from the last complete checkpoint.
  When process 0 itself dies the coordination service dies with it, and JAX ends the others
  at once with its own message ("... another task died ...").
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging as pylogging
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from absl import flags, logging

ALIVE_KEY = "nested/alive/{}"  # a process's heartbeat counter in the key-value store
DONE = "done"  # a finished process's last beat: no longer expected to beat


class DistributedError(RuntimeError):
    """The processes of a run cannot be joined; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """How this process joins a run: explicit (``coordinator_address``, ``num_processes``,
    ``process_id``), from the cluster's environment (``from_environment``), or not at all
    (the default: one process). ``timeout``: seconds to reach the coordinator; ``heartbeat``:
    seconds of silence after which a peer counts as lost."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    from_environment: bool = False
    timeout: int = 300
    heartbeat: int = 20

    @property
    def explicit(self) -> bool:
        fields = (self.coordinator_address, self.num_processes, self.process_id)
        return any(f is not None for f in fields)


def define_flags() -> dict[str, flags.FlagHolder]:
    """The multi-process flags of an entry point (``experiments/train.py``, ``eval.py``)."""
    return {
        "coordinator_address": flags.DEFINE_string(
            "coordinator_address", None, "HOST:PORT of process 0, where the processes meet."
        ),
        "num_processes": flags.DEFINE_integer("num_processes", None, "Processes in the run."),
        "process_id": flags.DEFINE_integer("process_id", None, "This process: 0..N-1."),
        "from_environment": flags.DEFINE_bool(
            "distributed",
            False,
            "Join the processes the cluster's environment describes (SLURM, Open MPI, "
            "Kubernetes, TPU pods), as jax.distributed.initialize() reads it.",
        ),
        "timeout": flags.DEFINE_integer(
            "distributed_timeout", 300, "Seconds to reach the coordinator."
        ),
        "heartbeat": flags.DEFINE_integer(
            "heartbeat_timeout", 20, "Seconds of silence after which a process counts as lost."
        ),
    }


def settings_from_flags(holders: dict[str, flags.FlagHolder]) -> Settings:
    return Settings(**{name: holder.value for name, holder in holders.items()})


def check(settings: Settings) -> tuple[str, int]:
    """Raise :class:`DistributedError` naming the flag unless the explicit settings are
    complete and consistent; returns the coordinator's ``(host, port)``."""
    names = ("coordinator_address", "num_processes", "process_id")
    missing = [f"--{n}" for n in names if getattr(settings, n) is None]
    if missing:
        raise DistributedError(
            f"{', '.join(missing)} missing: a multi-process run needs --coordinator_address, "
            "--num_processes and --process_id (or --distributed on a cluster that sets them)"
        )
    n, i = settings.num_processes, settings.process_id
    if n < 1:
        raise DistributedError(f"--num_processes={n} must be at least 1")
    if not 0 <= i < n:
        raise DistributedError(
            f"--process_id={i} is out of range for --num_processes={n}; use 0..{n - 1}"
        )
    host, _, port = settings.coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"--coordinator_address={settings.coordinator_address!r} must be HOST:PORT "
            "(e.g. 127.0.0.1:1234), the address of process 0"
        )
    limits = {"distributed_timeout": settings.timeout, "heartbeat_timeout": settings.heartbeat}
    for flag, seconds in limits.items():
        if seconds < 1:
            raise DistributedError(f"--{flag}={seconds} must be >= 1 second")
    return host.strip("[]"), int(port)


def _wait_for(host: str, port: int, timeout: int, settings: Settings) -> None:
    """Return once ``host:port`` accepts connections; raise :class:`DistributedError` after
    ``timeout`` seconds (JAX itself would abort the process with a stack trace)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                why = error.strerror or error
                raise DistributedError(
                    f"--coordinator_address={settings.coordinator_address}: no coordinator "
                    f"answered within --distributed_timeout={timeout} s ({why}); "
                    "start process 0 with the same address, or check the host and port"
                ) from None
            time.sleep(0.2)


def _check_bindable(host: str, port: int, settings: Settings) -> None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as error:
        raise DistributedError(
            f"--coordinator_address={settings.coordinator_address}: process 0 cannot listen "
            f"there ({error.strerror}); pick a free port on this host"
        ) from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def initialize(settings: Settings) -> None:
    """Join the run's processes (nothing for a single-process run); call before any other
    use of JAX. On CPU the collectives go through gloo. Starts the :class:`Watchdog` and
    tags this process's log lines with its index."""
    if not (settings.explicit or settings.from_environment):
        return
    options = {
        "initialization_timeout": settings.timeout,
        # JAX's own detection of a lost process, a backstop behind the watchdog's message.
        "heartbeat_timeout_seconds": 3 * settings.heartbeat,
    }
    if settings.explicit:
        host, port = check(settings)
        if settings.num_processes == 1:
            return
        if settings.process_id == 0:
            _check_bindable(host, port, settings)
        else:
            _wait_for(host, port, settings.timeout, settings)
        if _is_loopback(host):  # listen where the processes are, not on every interface
            options["coordinator_bind_address"] = f"{host}:{port}"
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            settings.coordinator_address,
            settings.num_processes,
            settings.process_id,
            **options,
        )
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(**options)
        except (ValueError, RuntimeError) as error:
            raise DistributedError(
                f"--distributed: {' '.join(str(error).split())}; on a cluster JAX does not "
                "detect, pass --coordinator_address, --num_processes and --process_id"
            ) from error
    _tag_logs(jax.process_index(), jax.process_count())
    if jax.process_count() > 1:
        global _watchdog
        _watchdog = Watchdog(settings.heartbeat)
        _watchdog.start()


def _tag_logs(index: int, count: int) -> None:
    """Prefix the log lines of processes other than 0 with ``[process i/n]``."""
    if index == 0:
        return

    def tag(record: pylogging.LogRecord) -> bool:
        record.msg = f"[process {index}/{count}] {record.msg}"
        return True

    logging.get_absl_handler().addFilter(tag)


class Watchdog(threading.Thread):
    """Beats this process's counter in the coordination service's key-value store every
    ``heartbeat / 5`` seconds and watches the others'; a peer whose counter has not moved
    for ``heartbeat`` seconds is reported on stderr and this process exits with status 1.
    :func:`finish` marks this process done (its silence is then expected)."""

    def __init__(self, heartbeat: float):
        super().__init__(name="nested-watchdog", daemon=True)
        self.client = _client()
        self.heartbeat = heartbeat
        self.me, self.count = jax.process_index(), jax.process_count()

    def run(self) -> None:
        beat, now = 0, time.monotonic()
        seen = {p: (None, now) for p in range(self.count) if p != self.me}
        while not _finished.is_set():
            if not threading.main_thread().is_alive():
                return  # exiting without finish(): an error; the others see the silence
            beat += 1
            try:
                self.client.key_value_set(ALIVE_KEY.format(self.me), str(beat), True)
                for peer, (last, since) in list(seen.items()):
                    value = self._value(peer)
                    if value == DONE:
                        del seen[peer]
                    elif value != last:
                        seen[peer] = (value, time.monotonic())
                    elif time.monotonic() - since > self.heartbeat:
                        self._lost(
                            f"process {peer} of {self.count} stopped responding (no "
                            f"heartbeat for {self.heartbeat} s: killed, crashed or hung)"
                        )
            except Exception as error:  # noqa: BLE001 - the coordination service is gone
                self._lost(f"the coordinator (process 0) is unreachable ({error})")
            _finished.wait(self.heartbeat / 5)

    def _value(self, peer: int) -> str | None:
        try:
            return self.client.key_value_try_get(ALIVE_KEY.format(peer))
        except Exception as error:  # noqa: BLE001 - NOT_FOUND: no beat yet
            if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
                return None
            raise

    def _lost(self, what: str) -> None:
        print(
            f"error: {what}; process {self.me} stops too. Relaunch every process to resume "
            "from the last complete checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # a collective may hold the main thread: no clean exit is possible


_finished = threading.Event()
_watchdog: Watchdog | None = None


def collective_failed(error: Exception) -> None:
    """Stop this process after a collective of a multi-process run failed in the main thread
    (a peer died and its connections closed, often before its heartbeat is missed): give the
    :class:`Watchdog` its heartbeat to name the lost process and exit 1, else exit 1 here with
    the collective's error. Returns (the caller re-raises) in a single-process run."""
    if _watchdog is None:
        return
    _finished.wait(1.5 * _watchdog.heartbeat)  # the watchdog's os._exit(1) comes first
    print(
        f"error: a collective operation failed ({' '.join(str(error).split())[:300]}); process "
        f"{_watchdog.me} stops. Relaunch every process to resume from the last complete "
        "checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _client():
    """The coordination service's client of this process (JAX keeps it private; orbax uses
    it the same way)."""
    from jax._src import distributed as runtime

    return runtime.global_state.client


def finish() -> None:
    """Tell the other processes this one's work is done: its watchdog stops, and its last
    beat says so (its silence is expected from now on)."""
    _finished.set()
    if jax.process_count() > 1:
        _client().key_value_set(ALIVE_KEY.format(jax.process_index()), DONE, True)


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (a collective: every process must
    call it at the same point)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def check_same(text: str, what: str, fix: str) -> None:
    """Raise :class:`DistributedError` on every process unless every process passed the same
    ``text`` (a collective); the message names ``what``, the processes that differ from
    process 0 and ``fix``."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(digest))
    differ = [i for i in range(len(gathered)) if not np.array_equal(gathered[i], gathered[0])]
    if differ:
        raise DistributedError(
            f"process(es) {differ} of {len(gathered)} were started with another {what} than "
            f"process 0; {fix}"
        )


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
