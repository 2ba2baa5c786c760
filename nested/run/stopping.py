"""Stopping a run cleanly: SIGTERM (a preemption) or SIGINT (Ctrl-C) ask the loop to save a
checkpoint of the step it reaches and raise :class:`Stopped`; a second signal ends the process
at once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


class Stopped(Exception):
    """The run was asked to stop (SIGTERM or SIGINT, ``signum``) and saved a checkpoint of the
    step it reached."""

    def __init__(self, step: int, directory: Path, signum: int = signal.SIGTERM):
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}: its checkpoint is in "
            f"{directory}; run the same command to resume from step {step}"
        )
        self.step, self.signum = step, signum


class StopRequest:
    """Set by the first SIGTERM or SIGINT (Ctrl-C): the loop then saves a checkpoint of the
    step it reaches and stops. ``signum`` is the signal that asked."""

    def __init__(self):
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self.signum is not None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """A :class:`StopRequest` that SIGTERM or SIGINT sets; a second one of either ends the
    process at once (the first says so on stderr). Outside the main thread no handler can be
    installed: nothing is, and the request stays unset."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        request.signum = signum
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        # os.write, not print: the main thread may be inside a buffered write.
        name = signal.Signals(signum).name
        os.write(
            2,
            f"\n{name}: saving a checkpoint at the end of this step, then stopping; "
            f"{name} again stops at once (steps since the last checkpoint are lost)\n".encode(),
        )

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
