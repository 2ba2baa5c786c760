"""Probes: measurements taken inside the inner loops of fast levels while a model runs.

A probe is an object with ``selects(level) -> bool`` and ``run(level, state, ctx) -> (o,
state)``. While it is active (``with probing(probe): ...`` around the code that traces the
model), :func:`nested.core.inner.run` hands every level the probe selects to ``probe.run``
instead of choosing a kernel or the generic loop, so the probe can run the level its own way
(the generic loop with an :class:`nested.core.inner.UpdateHook`, say) and keep what it
measured. Nothing else changes: the model, its fast state and every other level run as
declared. :mod:`nested.plasticity` is built on it.

A probe works at trace time, call by call, so it sees each inner-loop call the model makes
once per trace. A level the model runs inside a ``lax.scan`` of its own (turns, Hope's chunks,
outer-loss spans) would be traced once for many calls: such scans run under
:func:`repeated`, and a probe selecting a level there raises instead of measuring something
else.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("nested_probe", default=None)
_REPEATED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nested_probe_repeated", default=None
)


class Probe(Protocol):
    def selects(self, level) -> bool:
        """Whether this probe runs ``level`` (a :class:`nested.Level`)."""

    def run(self, level, state, ctx):
        """Run the level over ``ctx`` from ``state``: ``(o (B, T, H, d_v), final state)``."""


@contextlib.contextmanager
def probing(probe: Probe) -> Iterator[Probe]:
    """Make ``probe`` the active one while the block runs (nested blocks: the innermost)."""
    token = _ACTIVE.set(probe)
    try:
        yield probe
    finally:
        _ACTIVE.reset(token)


def active(level) -> Probe | None:
    """The active probe if it selects ``level``, else None; raises ``ValueError`` when it
    selects a level that runs inside a scan of the model (:func:`repeated`)."""
    probe = _ACTIVE.get()
    if probe is None or not probe.selects(level):
        return None
    why = _REPEATED.get()
    if why is not None:
        raise ValueError(
            f"level {level.name!r} cannot be probed where it runs: {why}, traced once for "
            f"many calls; measure a level the model runs once per sequence (a memory layer's)"
        )
    return probe


@contextlib.contextmanager
def repeated(why: str) -> Iterator[None]:
    """Mark the block as the body of a scan of the model (``why`` says which), where probes
    cannot measure a level call by call."""
    token = _REPEATED.set(why)
    try:
        yield
    finally:
        _REPEATED.reset(token)
