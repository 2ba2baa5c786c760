"""Tasks by name, so a config can choose one: ``make_task(config.data.name, **fields)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from nested.data.batch import Task
from nested.data.char_lm import CharLMTask
from nested.data.companion import CompanionTask
from nested.data.continual import ContinualTask
from nested.data.mqar import MQARTask
from nested.data.niah import NIAHTask
from nested.data.tokens import TokensTask

TASKS: Mapping[str, type] = {
    "mqar": MQARTask,
    "niah": NIAHTask,
    "char_lm": CharLMTask,
    "continual": ContinualTask,
    "companion": CompanionTask,
    "tokens": TokensTask,
}


def _frozen(value):
    # Configs (ml_collections, JSON) deliver lists; the frozen task configs want tuples.
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(_frozen(v) for v in value)
    return value


def make_task(name: str, **fields) -> Task:
    """Builds task ``name`` of ``TASKS`` from its config fields (lists become tuples).

    Raises ``ValueError`` naming an unknown task or field and listing the allowed ones, and
    the task's own ``ValueError`` for an invalid value.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task name={name!r}; allowed: {sorted(TASKS)}")
    cls = TASKS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for task {name!r}; allowed: {allowed}")
    return cls(**{k: _frozen(v) for k, v in fields.items()})
