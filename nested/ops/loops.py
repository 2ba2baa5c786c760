"""The sequential loop every op and model runs over chunks, periods or spans.

``remat_scan(step, carry, xs)`` is ``jax.lax.scan(jax.checkpoint(step), carry, xs)``: the
backward stores each iteration's carry and recomputes its step. A loop of one iteration
(a sequence of one chunk, Hope's span of one period) runs as one call of ``step``, without a
loop and without the checkpoint. Two costs go away then. A pullback that does not read the
final carry (Hope's span gradients to its CMS blocks: only the logits are read) no longer
runs that carry's backward, which a scan's vjp runs on zero cotangents. And the step is not
recomputed a second time inside a caller that rematerialises it already (Hope's span, a
layer's ``remat``); where none does, one step's saved values are what its recomputation
would hold anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def remat_scan(step: Callable, carry, xs, *, policy: Callable | None = None):
    """``(carry, ys)`` of ``step(carry, x) -> (carry, y)`` over the leading axis of every leaf
    of ``xs``, each step rematerialised with the checkpoint ``policy`` (None: save nothing);
    ``ys`` stacked on a leading axis, as ``jax.lax.scan`` gives them. One iteration: a call
    (module docstring)."""
    length = {x.shape[0] for x in jax.tree.leaves(xs)}
    if len(length) != 1:
        raise ValueError(f"remat_scan: xs' leaves have leading axes {sorted(length)}; need one")
    if length == {1}:
        carry, y = step(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda a: a[None], y)
    return jax.lax.scan(jax.checkpoint(step, prevent_cse=False, policy=policy), carry, xs)
