"""The sequential loop every op and model runs over chunks, periods or spans.

``remat_scan(step, carry, xs)`` is ``jax.lax.scan(jax.checkpoint(step), carry, xs)``: the
backward stores each iteration's carry and recomputes its step. A loop of one iteration
(a sequence of one chunk, Hope's span of one period) runs as one checkpointed call of
``step``, without a loop: a pullback that does not read the final carry (Hope's span
gradients to its CMS blocks: only the logits are read) then drops that carry's backward as
dead code, which a scan's vjp runs on zero cotangents. The checkpoint stays, so a single
large chunk (``every=2048``) holds no more for the backward than a loop of them would.

A loop inside the step of another (the chunks of a memory inside a span of Hope's outer-loss
levels) is not checkpointed again: the enclosing step is already recomputed as a whole for its
backward, so an inner checkpoint would only recompute the same values a third time, and what
the inner loop holds for its backward lives for one enclosing step only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import jax

_ENCLOSED = contextvars.ContextVar("remat_scan_enclosed", default=False)


def _enclosing(step: Callable) -> Callable:
    """``step``, traced with the loops inside it marked as enclosed (module docstring)."""

    def body(carry, x):
        token = _ENCLOSED.set(True)
        try:
            return step(carry, x)
        finally:
            _ENCLOSED.reset(token)

    return body


def remat_scan(step: Callable, carry, xs, *, policy: Callable | None = None):
    """``(carry, ys)`` of ``step(carry, x) -> (carry, y)`` over the leading axis of every leaf
    of ``xs``, each step rematerialised with the checkpoint ``policy`` (None: save nothing)
    unless an enclosing ``remat_scan`` step already is; ``ys`` stacked on a leading axis, as
    ``jax.lax.scan`` gives them. One iteration: a call (module docstring)."""
    length = {x.shape[0] for x in jax.tree.leaves(xs)}
    if len(length) != 1:
        raise ValueError(f"remat_scan: xs' leaves have leading axes {sorted(length)}; need one")
    if _ENCLOSED.get():
        body = step
    else:
        body = jax.checkpoint(_enclosing(step), prevent_cse=False, policy=policy)
    if length == {1}:
        carry, y = body(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda a: a[None], y)
    return jax.lax.scan(body, carry, xs)
