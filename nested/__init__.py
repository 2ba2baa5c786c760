"""nested: nested learning in JAX.

Declare levels (objective, memory, update rule, period), compose them into a
:class:`NestedSystem`, and :func:`compile` it into pure, jit-able ``init`` / ``apply`` /
``train_step`` functions that differentiate through every inner loop.

A trained run: :func:`load` (``(program, state)`` of a workdir), :func:`generate` (sampling,
every fast state carried token by token), :func:`export_model` / :func:`import_model` (one
portable file). These come from :mod:`nested.run` on first use, so ``import nested`` does not
load the run machinery (orbax, the training loop).
"""

import importlib

from nested.core.inner import Context
from nested.core.level import Level, LevelState
from nested.core.scheduler import Program, State, compile
from nested.core.system import NestedSystem
from nested.learn import memories, objectives, rules
from nested.levels import recipes

_RUN = {
    "load": "loading",
    "load_trained": "loading",
    "Trained": "loading",
    "generate": "sampling",
    "Sample": "sampling",
    "export_model": "export",
    "import_model": "export",
}


def __getattr__(name: str):
    if name in _RUN:
        return getattr(importlib.import_module(f"nested.run.{_RUN[name]}"), name)
    raise AttributeError(f"module 'nested' has no attribute {name!r}")


__all__ = [
    "Context",
    "Level",
    "LevelState",
    "NestedSystem",
    "Program",
    "Sample",
    "State",
    "Trained",
    "compile",
    "export_model",
    "generate",
    "import_model",
    "load",
    "load_trained",
    "memories",
    "objectives",
    "recipes",
    "rules",
]
