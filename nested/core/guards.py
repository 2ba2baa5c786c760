"""Numerical guards: a non-finite loss, gradient or fast state never passes silently.

``health(loss, grads, fast)`` returns one boolean per quantity (``finite/loss``,
``finite/grads``, ``finite/<level>`` for every level's final fast state), computed inside the
jitted step; :func:`failure` turns a step's metrics into a message naming the step, the level
and the quantity, which the training loop raises (or, with ``skip_nonfinite``, the step keeps
its previous state and counts the skip).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from nested.core.level import LevelState

PREFIX = "finite/"


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss, gradient or fast state."""


def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def health(loss: jax.Array, grads: Any, fast: Any) -> dict[str, jax.Array]:
    """Finiteness of the loss, the gradients, and each level's fast state."""
    flags = {f"{PREFIX}loss": jnp.isfinite(loss), f"{PREFIX}grads": all_finite(grads)}
    states: dict[str, list] = {}
    for leaf in jax.tree.leaves(fast, is_leaf=lambda x: isinstance(x, LevelState)):
        if isinstance(leaf, LevelState):
            states.setdefault(leaf.level, []).append((leaf.params, leaf.opt_state))
    for level, trees in states.items():
        flags[f"{PREFIX}{level}"] = all_finite(trees)
    return flags


def healthy(flags: Mapping[str, jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack(list(flags.values())))


def failure(metrics: Mapping[str, Any], step: int) -> str | None:
    """The message for the first non-finite quantity in ``metrics``, or None."""
    bad = [
        name[len(PREFIX) :]
        for name, ok in metrics.items()
        if name.startswith(PREFIX) and not bool(ok)
    ]
    if not bad:
        return None
    what = {"loss": "the outer loss", "grads": "the outer gradients"}
    named = [what.get(name, f"the fast state of level {name!r}") for name in bad]
    return f"step {step}: non-finite values in " + ", ".join(named)
