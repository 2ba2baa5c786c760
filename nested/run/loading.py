"""A trained run, loaded from its workdir: ``load(workdir) -> (program, state)``.

The workdir's ``config.json`` (written by ``experiments/train.py``) builds the program, and the
latest readable checkpoint of ``<workdir>/checkpoints`` is restored into it, as evaluation does
(a damaged step is set aside and the previous one used; a checkpoint of another model raises
:class:`nested.run.checkpoint.CheckpointError`). :func:`load_trained` returns the whole
:class:`Trained` (the experiment: config, task and program; the state, its step, the
model's fingerprint), which sampling (:mod:`nested.run.sampling`) and export
(:mod:`nested.run.export`) use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from nested.core.scheduler import Program, State
from nested.run import config as config_lib
from nested.run import fingerprint, rundir
from nested.run.config import Experiment


class Trained(NamedTuple):
    """A trained model: the experiment its config builds, its state and checkpoint step."""

    experiment: Experiment
    state: State
    step: int

    @property
    def program(self) -> Program:
        return self.experiment.program

    @property
    def config(self):
        return self.experiment.config

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The model a saved state must match (:func:`nested.run.fingerprint.of`)."""
        return fingerprint.of(self.config, self.step)


def load_trained(workdir: str | Path, step: int | None = None) -> Trained:
    """The run trained in ``workdir``: its config and the state of its latest readable
    checkpoint (``step``: that one) (slow parameters, optimizer state, carried fast states,
    step, RNG)."""
    experiment = config_lib.build(rundir.load_workdir_config(workdir))
    restored = rundir.restore_latest(experiment, rundir.check_run(workdir), step=step)
    return Trained(experiment, restored.state, restored.step)


def load(workdir: str | Path) -> tuple[Program, State]:
    """``(program, state)`` of the run trained in ``workdir`` (see :func:`load_trained`)."""
    trained = load_trained(workdir)
    return trained.program, trained.state
