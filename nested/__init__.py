"""nested: nested learning in JAX.

Declare levels (objective, memory, update rule, period), compose them into a
:class:`NestedSystem`, and :func:`compile` it into pure, jit-able ``init`` / ``apply`` /
``train_step`` functions that differentiate through every inner loop.
"""

from nested.core.inner import Context
from nested.core.level import Level, LevelState
from nested.core.scheduler import Program, State, compile
from nested.core.system import NestedSystem
from nested.learn import memories, objectives, recipes, rules

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
