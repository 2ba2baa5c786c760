"""What a model spends on an agent: slow parameters, and the bytes of state it carries.

Comparisons of memory designs are fair only at equal budgets: the same slow-parameter count
and the same bytes carried from one sequence of an agent to the next (every level with
``persist="stream"``: memories, their rule state such as momentum or a pending accumulated
update, and the caches that continue with them). Both come from shapes alone
(``jax.eval_shape``: nothing is allocated).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from nested.core.level import LevelState


class Budget(NamedTuple):
    """``slow_parameters``: every trained parameter; ``carried_bytes``: the fast state one
    agent (a batch row) carries across sequences."""

    slow_parameters: int
    carried_bytes: int

    def describe(self) -> str:
        return (
            f"{self.slow_parameters:,} slow parameters, {self.carried_bytes:,} bytes carried per "
            "agent"
        )


def budget(program) -> Budget:
    """The :class:`Budget` of a compiled program (:class:`nested.Program`)."""
    state = jax.eval_shape(lambda: program.init(jax.random.key(0), batch_size=1))
    slow = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))

    def carried(x) -> int:
        if isinstance(x, LevelState) and program.system[x.level].persist != "stream":
            return 0
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(x))

    is_state = lambda x: isinstance(x, LevelState)
    leaves = jax.tree.leaves(state.fast, is_leaf=is_state)
    return Budget(slow, sum(carried(x) for x in leaves))
