"""Regret utility: does what a model learned on task A lower the regret of learning task B?

    U(dtheta_A) = E_B[Regret_B(theta_0) - Regret_B(theta_0 + dtheta_A)]

``Regret_B(theta)`` here is the cumulative online loss of a session on task ``B`` while the
fast levels learn it (test-then-train: every sequence is scored as the model reads it, then
what it wrote is kept), slow weights frozen, starting from ``theta``. Two kinds of
``dtheta_A``, so they can be compared:

* fast (:func:`fast_regret`): ``theta_0`` is the fresh learned initial fast state and
  ``theta_0 + dtheta_A`` the fast state a session on ``A`` left (what a deployed model
  learns at test time);
* slow (:func:`slow_regret`): ``dtheta_A`` is the change of the slow weights (and so of the
  learned initial states) after a few outer steps on ``A``; both sessions on ``B`` start from
  the fresh fast state of their weights.

Sessions are the rows of a batch (independent streams), so the expectation and its bootstrap
interval are over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from nested.plasticity.deployment import HELD_OUT, Deployment

# Batch indices of priming sessions and of the scored sessions: disjoint from each other and
# from the held-out batches of the continual-learning matrix.
PRIME, SCORED = 2 * HELD_OUT, 3 * HELD_OUT


def bootstrap_ci(
    samples,
    *,
    statistic: Callable[..., np.ndarray] = np.mean,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    axis: int = 0,
):
    """Percentile bootstrap of ``statistic`` over the sessions axis of ``samples``.

    ``samples`` is ``(S, ...)`` after moving ``axis`` to the front, S >= 2 sessions. Returns
    ``(estimate, low, high)``, each of the trailing shape: ``estimate = statistic(samples,
    axis=0)``; ``low``/``high`` are the ``100 (1-level)/2`` and ``100 (1+level)/2`` percentiles
    of the statistic over ``resamples`` resamples of the S sessions drawn with replacement from
    ``np.random.default_rng(seed)``. ``statistic`` must take an ``axis`` keyword: all resamples
    are evaluated in one call on a ``(resamples, S, ...)`` array.
    """
    x = np.moveaxis(np.asarray(samples, dtype=np.float64), axis, 0)
    S = x.shape[0]
    if S < 2:
        raise ValueError(f"samples: need at least 2 sessions along axis {axis}, got {S}")
    if not 0 < level < 1:
        raise ValueError(f"level: must lie strictly between 0 and 1, got {level}")
    estimate = statistic(x, axis=0)
    idx = np.random.default_rng(seed).integers(0, S, size=(resamples, S))
    stats = statistic(x[idx], axis=1)
    low, high = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return estimate, low, high


def regret_utility(fresh, primed, **bootstrap_kwargs) -> dict:
    """Regret utility of section 5.3 of the seed document, with a bootstrap interval.

    ``U(A, B) = E_sessions[Regret_B(theta_0) - Regret_B(theta_0 + dtheta_A)]``: how much a
    session on task A, before one on task B, lowers B's regret. Regret is cumulative online loss
    minus a comparator's; the comparator is the same in both terms and cancels, so cumulative
    online losses suffice.

    ``fresh`` is ``(S, N_B)``: the cumulative online loss of session ``s`` on task B from the
    fresh initial state; ``primed`` is ``(S, N_A, N_B)``: the same from the state a session on
    task A left. The per-session differences ``fresh[:, None, :] - primed`` are bootstrapped
    over sessions (``bootstrap_kwargs`` go to ``bootstrap_ci``). Returns ``{"utility",
    "low", "high"}``, each ``(N_A, N_B)``, and ``"sessions": S``. U is exactly 0 when
    ``primed`` equals ``fresh`` broadcast; positive U means priming on A helps B.
    """
    fresh = np.asarray(fresh, dtype=np.float64)
    primed = np.asarray(primed, dtype=np.float64)
    if fresh.ndim != 2 or fresh.shape[0] < 2:
        raise ValueError(f"fresh: expected (S, N_B) with S >= 2 sessions, got {fresh.shape}")
    S, n_b = fresh.shape
    if primed.ndim != 3 or primed.shape[0] != S or primed.shape[2] != n_b:
        raise ValueError(f"primed: expected ({S}, N_A, {n_b}) to match fresh, got {primed.shape}")
    utility, low, high = bootstrap_ci(fresh[:, None, :] - primed, **bootstrap_kwargs)
    return {"utility": utility, "low": low, "high": high, "sessions": S}


def online_losses(deployment: Deployment, fast, batches) -> np.ndarray:
    """``(n, rows)``: each batch's loss per scored position, row by row, in a session from
    ``fast`` (test-then-train)."""
    _, parts = deployment.session(fast, batches)
    return np.stack([p["loss"] / np.maximum(p["count"], 1.0) for p in parts])


def _result(tasks, fresh: dict, primed: dict, **bootstrap_kwargs) -> dict:
    """The utility matrix from per-task loss curves ``(n, rows)``; with mean cumulative curves."""
    cumulative = lambda losses: np.cumsum(losses, axis=0).mean(axis=1).tolist()
    total = lambda losses: losses.sum(axis=0)  # (rows,): Regret_B of each session
    fresh_rows = np.stack([total(fresh[b]) for b in tasks], axis=1)
    primed_rows = np.stack(
        [np.stack([total(primed[a, b]) for b in tasks], axis=1) for a in tasks], axis=1
    )
    out = regret_utility(fresh_rows, primed_rows, **bootstrap_kwargs)
    out["tasks"] = list(tasks)
    out["curves"] = {
        "fresh": {str(b): cumulative(fresh[b]) for b in tasks},
        "primed": {f"{a}->{b}": cumulative(primed[a, b]) for a in tasks for b in tasks},
    }
    return out


def fast_regret(
    deployment: Deployment,
    batch_of: Callable[[int, int], dict],
    tasks: Sequence[int],
    *,
    session_length: int,
    prime_length: int | None = None,
    progress: Callable[[], None] = lambda: None,
    **bootstrap_kwargs,
) -> dict:
    """``U(A, B)`` with ``dtheta_A`` in the fast state: for every task ``B``, a scored session of
    ``session_length`` batches from the fresh fast state and from the fast state a priming
    session of ``prime_length`` (default ``session_length``) batches on each ``A`` left.
    Returns :func:`regret_utility`'s dict with ``tasks`` and the mean cumulative loss
    ``curves`` (fresh per ``B``, primed per ``"A->B"``)."""
    scored = {b: [batch_of(b, SCORED + n) for n in range(session_length)] for b in tasks}
    fresh_state = deployment.fresh()
    fresh = {}
    for b in tasks:
        fresh[b] = online_losses(deployment, fresh_state, scored[b])
        progress()
    primed = {}
    for a in tasks:
        length = session_length if prime_length is None else prime_length
        prime = [batch_of(a, PRIME + n) for n in range(length)]
        after_a, _ = deployment.session(fresh_state, prime)
        for b in tasks:
            primed[a, b] = online_losses(deployment, after_a, scored[b])
            progress()
    return _result(tasks, fresh, primed, **bootstrap_kwargs)


def outer_adam(program, learning_rate: float):
    """``(tx, step)``: Adam at ``learning_rate`` and its jitted step ``(params, opt_state,
    batch) -> (params, opt_state)`` on the outer loss of ``batch`` from the fresh fast state.
    That state is built from the differentiated ``params`` (``program.loss`` without a state),
    so the learned initial states move with the rest of the slow weights."""
    tx = optax.adam(learning_rate)

    @jax.jit
    def step(params, opt_state, batch):
        grads, _ = jax.grad(program.loss, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def slow_regret(
    program,
    params,
    batch_of: Callable[[int, int], dict],
    tasks: Sequence[int],
    *,
    batch_size: int,
    outer_steps: int,
    learning_rate: float,
    session_length: int,
    progress: Callable[[], None] = lambda: None,
    **bootstrap_kwargs,
) -> dict:
    """``U(A, B)`` with ``dtheta_A`` in the slow weights: ``outer_steps`` steps of Adam
    (``learning_rate``) on batches of ``A``, each from the fresh fast state (so the change is
    the slow weights', the learned initial states included), then scored sessions on every
    ``B`` from the fresh fast state of the new weights, against the same from ``params``.
    Returns what :func:`fast_regret` does."""
    tx, outer_step = outer_adam(program, learning_rate)
    deployed = Deployment(program, params, batch_size)  # compiled once for every weights

    def scored_sessions(weights) -> dict:
        deployment = deployed.with_params(weights)
        out = {}
        for b in tasks:
            batches = [batch_of(b, SCORED + n) for n in range(session_length)]
            out[b] = online_losses(deployment, deployment.fresh(), batches)
            progress()
        return out

    fresh = scored_sessions(params)
    primed = {}
    for a in tasks:
        weights, opt_state = params, tx.init(params)
        for n in range(outer_steps):
            batch = batch_of(a, PRIME + n)
            weights, opt_state = outer_step(weights, opt_state, program.check_batch(batch))
        for b, losses in scored_sessions(weights).items():
            primed[a, b] = losses
    return _result(tasks, fresh, primed, **bootstrap_kwargs)
