"""nested: nested learning in JAX.

Declare levels (objective, memory, update rule, period), compose them into a
:class:`NestedSystem`, and :func:`compile` it into pure, jit-able ``init`` / ``apply`` /
``train_step`` functions that differentiate through every inner loop.
"""

from nested import memories, objectives, recipes, rules
from nested.inner import Context
from nested.level import Level, LevelState
from nested.scheduler import Program, State, compile
from nested.system import NestedSystem

__all__ = [
    "Context",
    "Level",
    "LevelState",
    "NestedSystem",
    "Program",
    "State",
    "compile",
    "memories",
    "objectives",
    "recipes",
    "rules",
]
