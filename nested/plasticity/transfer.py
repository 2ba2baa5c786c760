"""The continual-learning matrix of a deployed model, and the metrics computed from it.

``R`` is a ``(T, T)`` float matrix: ``R[i, j]`` is the metric (e.g. accuracy) on task ``j``
after the training/deployment phase of task ``i``, tasks taken in the order ``0, ..., T - 1``.
Row ``T - 1`` is the final state; the diagonal is each task right after its own phase. ``b`` is
a ``(T,)`` vector: the metric on each task before any phase (the initial state). All formulas
below are 0-based, exactly as in the code; the papers write the same sums 1-based.

The metrics are pure NumPy on an ``R`` already measured. :func:`transfer_matrix` measures
``R`` on a deployment (:mod:`nested.plasticity.deployment`) over a task sequence;
:func:`windowed_matrix` measures it over windows of a stream without task boundaries, where
forgetting would otherwise never appear.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from nested.plasticity.deployment import HELD_OUT, Deployment
from nested.plasticity.regret import bootstrap_ci


def check_matrix(R, name: str = "R") -> np.ndarray:
    """``R`` as a float64 ``(T, T)`` array, T >= 1, all entries finite; ValueError otherwise."""
    R = np.asarray(R, dtype=np.float64)
    if R.ndim != 2 or R.shape[0] != R.shape[1] or R.shape[0] < 1:
        raise ValueError(f"{name}: expected a square (T, T) matrix with T >= 1, got {R.shape}")
    if not np.all(np.isfinite(R)):
        raise ValueError(f"{name}: holds NaN or inf; pass finite metric values only")
    return R


def average_accuracy(R) -> float:
    """Average accuracy (ACC), GEM (Lopez-Paz & Ranzato, 2017).

    ``ACC = (1/T) sum_{j=0}^{T-1} R[T-1, j]``: the mean over tasks of the final row.
    """
    R = check_matrix(R)
    return float(R[-1].mean())


def backward_transfer(R) -> float:
    """Backward transfer (BWT), GEM (Lopez-Paz & Ranzato, 2017).

    ``BWT = 1/(T-1) sum_{j=0}^{T-2} (R[T-1, j] - R[j, j])``; negative means forgetting.
    Undefined for T == 1 (no earlier task): returns nan.
    """
    R = check_matrix(R)
    T = R.shape[0]
    if T == 1:
        return float("nan")
    return float(np.mean(R[-1, :-1] - np.diag(R)[:-1]))


def forward_transfer(R, b) -> float:
    """Forward transfer (FWT), GEM (Lopez-Paz & Ranzato, 2017).

    ``FWT = 1/(T-1) sum_{j=1}^{T-1} (R[j-1, j] - b[j])``: the metric on task ``j`` just before
    its own phase, against the initial state ``b`` (shape ``(T,)``). Undefined for T == 1
    (no later task): returns nan.
    """
    R = check_matrix(R)
    T = R.shape[0]
    b = np.asarray(b, dtype=np.float64)
    if b.shape != (T,):
        raise ValueError(f"b: expected shape ({T},) to match R, got {b.shape}")
    if not np.all(np.isfinite(b)):
        raise ValueError("b: holds NaN or inf; pass finite metric values only")
    if T == 1:
        return float("nan")
    return float(np.mean(np.diag(R, k=1) - b[1:]))


def forgetting_max_per_task(R) -> np.ndarray:
    """Forgetting of each task ``j < T-1``, Chaudhry et al. 2018 (RWalk, "Riemannian Walk for
    Incremental Learning"), at the final phase ``k = T-1``.

    ``f_j = max_{l=0}^{T-2} R[l, j] - R[T-1, j]``, shape ``(T-1,)``. As in the paper
    (``max_{l in {1..k-1}}``), the max runs over all earlier phases, including those before
    task ``j`` was learned.
    """
    R = check_matrix(R)
    # ``initial`` only makes T == 1 (no earlier phase) give an empty result instead of raising.
    return R[:-1, :-1].max(axis=0, initial=-np.inf) - R[-1, :-1]


def forgetting_max(R) -> float:
    """Average forgetting, Chaudhry et al. 2018 (RWalk): ``1/(T-1) sum_{j=0}^{T-2} f_j`` with
    ``f_j`` from ``forgetting_max_per_task``. Undefined for T == 1: returns nan."""
    f = forgetting_max_per_task(R)
    return float(f.mean()) if f.size else float("nan")


def forgetting_first_last_per_task(R) -> np.ndarray:
    """First-minus-last forgetting of each task ``j < T-1``: ``R[j, j] - R[T-1, j]``, the metric
    right after task ``j``'s own phase minus at the end; shape ``(T-1,)``. Unlike
    ``forgetting_max_per_task`` it ignores a peak reached after the task's own phase."""
    R = check_matrix(R)
    return np.diag(R)[:-1] - R[-1, :-1]


def forgetting_first_last(R) -> float:
    """Mean first-minus-last forgetting ``1/(T-1) sum_{j=0}^{T-2} (R[j, j] - R[T-1, j])``
    (equal to ``-BWT`` of GEM). Undefined for T == 1: returns nan."""
    f = forgetting_first_last_per_task(R)
    return float(f.mean()) if f.size else float("nan")


def learning_curve_area(Z, beta: int) -> float:
    """Learning curve area (LCA), A-GEM (Chaudhry et al. 2019, "Efficient Lifelong Learning
    with A-GEM").

    ``Z`` is ``(T, n)``: ``Z[k, b]`` is the metric on task ``k`` after the ``b``-th minibatch
    (session) of training on task ``k``, ``b = 0`` before the first one. With
    ``Z_b = (1/T) sum_k Z[k, b]``, ``LCA_beta = 1/(beta+1) sum_{b=0}^{beta} Z_b``, for
    ``0 <= beta <= n-1``: the area under the average early learning curve.
    """
    Z = np.asarray(Z, dtype=np.float64)
    if Z.ndim != 2 or Z.shape[0] < 1 or Z.shape[1] < 1:
        raise ValueError(f"Z: expected a (T, n) matrix with T, n >= 1, got {Z.shape}")
    if not np.all(np.isfinite(Z)):
        raise ValueError("Z: holds NaN or inf; pass finite metric values only")
    n = Z.shape[1]
    if not 0 <= beta <= n - 1:
        raise ValueError(f"beta: must lie in [0, {n - 1}] for Z with n = {n} columns, got {beta}")
    return float(Z[:, : beta + 1].mean())


def summary(R, b=None, curves=None, beta: int | None = None) -> dict[str, float]:
    """All metrics of ``R`` as floats (nan where undefined, e.g. T == 1).

    Keys: ``average_accuracy``, ``backward_transfer``, ``forward_transfer`` (only if ``b`` is
    given), ``forgetting_max``, ``forgetting_first_last``, ``learning_curve_area`` (only if
    ``curves``, the ``(T, n)`` matrix ``Z``, is given; ``beta`` defaults to ``n - 1``).
    """
    out = {"average_accuracy": average_accuracy(R), "backward_transfer": backward_transfer(R)}
    if b is not None:
        out["forward_transfer"] = forward_transfer(R, b)
    out["forgetting_max"] = forgetting_max(R)
    out["forgetting_first_last"] = forgetting_first_last(R)
    if curves is not None:
        n = np.shape(curves)[-1]
        out["learning_curve_area"] = learning_curve_area(curves, n - 1 if beta is None else beta)
    return out


# Metrics where higher is better; summaries are computed for these only (not for the loss).
SCORES = ("accuracy", "memory_accuracy", "in_context_accuracy")


def _tables(rows, initial, curves=None, agents=None) -> dict:
    """Stack lists of per-evaluation dicts into ``R``, ``b`` (and ``Z``) per metric, with the
    :func:`summary` of every score; with ``agents`` (the same evaluations per batch row, as
    :func:`nested.plasticity.deployment.row_rates`), also ``intervals``: per score and summary
    key ``[mean over agents, low, high]``, the 95% bootstrap interval of the mean of the
    agents' own summaries (:func:`agent_intervals`)."""
    names = list(rows[0][0])
    out = {
        "R": {m: np.array([[x[m] for x in row] for row in rows]) for m in names},
        "b": {m: np.array([x[m] for x in initial]) for m in names},
    }
    if curves is not None:
        out["curves"] = {m: np.array([[x[m] for x in c] for c in curves]) for m in names}
    out["summary"] = {
        m: summary(out["R"][m], out["b"][m], None if curves is None else out["curves"][m])
        for m in names
        if m in SCORES
    }
    if agents is not None:
        rows_of, initial_of = agents
        out["intervals"] = {
            m: agent_intervals(
                np.array([[x[m] for x in row] for row in rows_of]),
                np.array([x[m] for x in initial_of]),
            )
            for m in names
            if m in SCORES
        }
    return out


def agent_intervals(R_rows, b_rows) -> dict[str, list[float]]:
    """``R_rows (T, T, A)`` and ``b_rows (T, A)``: each agent's matrix; returns for every
    :func:`summary` key (but the learning curve area) ``[mean, low, high]`` over the agents
    whose matrix is finite (an agent that met no query of a kind has none), the interval a
    95% percentile bootstrap over those agents (``nested.plasticity.regret.bootstrap_ci``)."""
    finite = np.all(np.isfinite(R_rows), axis=(0, 1)) & np.all(np.isfinite(b_rows), axis=0)
    per_agent = [summary(R_rows[..., a], b_rows[:, a]) for a in np.flatnonzero(finite)]
    if len(per_agent) < 2:
        return {}
    return {
        key: [float(v) for v in bootstrap_ci(np.array([s[key] for s in per_agent]))]
        for key in per_agent[0]
        if np.all(np.isfinite([s[key] for s in per_agent]))
    }


def tracking_matrix(mappings, keys=None) -> np.ndarray:
    """``R`` of an ideal learner of the *current* mapping alone: ``mappings (A, T, K)`` the
    values of ``A`` agents' ``T`` tasks, task ``t``'s value ``i`` that of key ``keys[t, i]``
    (``keys (T, K)``; default: the same keys ``0 .. K - 1`` in every task); ``R[i, j]`` is the
    share of task ``j``'s keys that task ``i`` holds with the same value (queries uniform over
    keys), so ``R[i, i] = 1``. Its backward transfer is the forgetting that remapping itself
    forces: no learner that answers a key with one value can score above it on keys whose
    value changed, whatever it remembers. With keys of its own for every task, ``R`` is the
    identity: a tracker recalls no earlier task, and whatever a model scores on one it
    remembered."""
    m = np.asarray(mappings)
    if m.ndim != 3:
        raise ValueError(f"mappings: expected (agents, tasks, keys), got shape {m.shape}")
    k = np.broadcast_to(np.arange(m.shape[2]), m.shape[1:]) if keys is None else np.asarray(keys)
    if k.shape != m.shape[1:]:
        raise ValueError(f"keys: expected (tasks, keys) = {m.shape[1:]}, got shape {k.shape}")
    table = np.full((m.shape[0], m.shape[1], int(k.max()) + 1), -1, dtype=np.int64)
    for t in range(m.shape[1]):
        table[:, t, k[t]] = m[:, t]
    held = table[:, :, k]  # (A, T_i, T_j, K): task i's value of each key of task j
    return np.mean(held == m[:, None, :, :], axis=(0, 3))


def transfer_matrix(
    deployment: Deployment,
    batch_of: Callable[[int, int], dict],
    tasks: Sequence[int],
    *,
    sessions: int,
    session_length: int,
    eval_batches: int,
    reset: Sequence[str] = (),
    progress: Callable[[], None] = lambda: None,
) -> dict:
    """``R`` of a deployment over the task sequence ``tasks`` (each task once).

    From the fresh fast state, phase ``i`` runs ``sessions`` sessions of ``session_length``
    batches of task ``tasks[i]`` (new batches every session, the fast state carried); after the
    phase, ``R[i, j]`` scores ``eval_batches`` held-out batches of task ``tasks[j]`` from the
    fast state reached (the same held-out batches every time, never learned from). ``b[j]``:
    the same before any phase. ``curves[i, s]``: task ``tasks[i]`` after ``s`` sessions of its
    phase (``s = 0``: before), for the learning curve area. ``batch_of(task, index)`` gives a
    batch (:func:`nested.plasticity.deployment.task_batches`). Returns ``{"tasks", "R", "b",
    "curves", "summary"}``: matrices per metric (loss, accuracy, memory_accuracy where the task
    marks queries answerable only from memory), summaries per score. ``reset``: levels whose
    state restarts at the end of every phase, before it is scored (an ablation: what the
    other levels hold of the tasks before).
    """
    tasks = list(tasks)
    if len(set(tasks)) != len(tasks) or not tasks:
        raise ValueError(
            f"tasks={tasks}: name each task once (phase i learns task i); a long stream that "
            f"returns to tasks is measured by the capacity protocol"
        )
    held_out = {j: [batch_of(j, HELD_OUT + e) for e in range(eval_batches)] for j in tasks}

    def score(fast, j):
        progress()
        return deployment.evaluate(fast, held_out[j], rows=True)

    fast = deployment.fresh()
    initial = [score(fast, j) for j in tasks]
    rows, curves, index = [], [], 0
    for task in tasks:
        curve = [score(fast, task)[0]]
        for _ in range(sessions):
            batches = [batch_of(task, index + n) for n in range(session_length)]
            fast, _ = deployment.session(fast, batches)
            index += session_length
            curve.append(score(fast, task)[0])
        curves.append(curve)
        if reset:
            fast = deployment.reset(fast, reset)
        rows.append([score(fast, j) for j in tasks])
    pooled = lambda scores: [x for x, _ in scores]
    agents = ([[a for _, a in row] for row in rows], [a for _, a in initial])
    tables = _tables([pooled(row) for row in rows], pooled(initial), curves, agents)
    return {"tasks": tasks, **tables}


def windowed_matrix(
    deployment: Deployment,
    batch_at: Callable[[int], dict],
    *,
    windows: int,
    window_batches: int,
    eval_batches: int,
    progress: Callable[[], None] = lambda: None,
) -> dict:
    """``R`` over windows of a stream without task boundaries.

    Window ``j`` is the stream's batches ``[j W, (j + 1) W)``, ``W = window_batches``; its last
    ``eval_batches`` are held out (never learned from). From the fresh fast state the
    deployment learns window after window from the others; after window ``i``, ``R[i, j]``
    scores window ``j``'s held-out batches. ``b[j]``: the same before any window.
    ``batch_at(index)``: the stream's batch ``index``
    (:func:`nested.plasticity.deployment.stream_batches`). Returns ``{"windows", "R", "b",
    "summary"}``.
    """
    if not 0 < eval_batches < window_batches:
        raise ValueError(
            f"eval_batches={eval_batches} must be in [1, window_batches={window_batches}): "
            f"each window learns from the batches it does not hold out"
        )
    learn = window_batches - eval_batches
    held_out = [
        [batch_at(j * window_batches + learn + e) for e in range(eval_batches)]
        for j in range(windows)
    ]

    def score(fast, j):
        progress()
        return deployment.evaluate(fast, held_out[j])

    fast = deployment.fresh()
    initial = [score(fast, j) for j in range(windows)]
    rows = []
    for i in range(windows):
        batches = [batch_at(i * window_batches + n) for n in range(learn)]
        fast, _ = deployment.session(fast, batches)
        rows.append([score(fast, j) for j in range(windows)])
    return {"windows": windows, **_tables(rows, initial)}
