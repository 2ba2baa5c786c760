"""Perplexity of a trained language model on the ``val`` split of a prepared corpus: the whole
split (:func:`perplexity`, bits per byte) and by position past the trained length
(:func:`by_position`), scored by :func:`make_score_fn` (also the multiple-choice tasks' scorer,
:mod:`nested.run.choice`). ``experiments/eval_lm.py`` runs both (:mod:`nested.run.lm_eval`).

Tokens are scored by the run's own :meth:`nested.core.scheduler.Program.apply`, given the
targets and the mask of real tokens as the training loss gives them (so levels that learn from
the outer loss learn in context as there): the per-token negative log-likelihood ``nll_t =
-log softmax(logits_t)[target_t]`` (:func:`nested.learn.objectives.token_cross_entropy`, the
terms of the training loss) in nats.

**Perplexity, bits per byte.** The val stream ``s_1 .. s_N`` (the documents, each followed by
EOS; N = the index's val ``tokens``) is scored whole, every token once: prefixed by EOS (what
precedes a document), ``x = (EOS, s_1, .., s_N)`` is cut into W = ceil(N / T) windows of T =
the run's val length (``task.eval_seq_len``, else ``seq_len``): window w has inputs
``x[wT : wT + T]`` and targets ``x[wT + 1 : wT + T + 1]``, the last one padded with EOS past
``s_N`` (mask 0). A run whose task aligns documents (``task.align`` A > 1) scores ``x`` laid out
as its training windows were (each document after EOS pads to a multiple of A, the pads masked,
so still every token once). The windows are laid out in B rows (``batch_size``) of K = ceil(W / B)
consecutive windows (row b: windows bK .. bK + K - 1, then fully masked ones) and scored K
batches in turn. Fast state follows the config as in training: a level with
``persist="stream"`` (and an attention cache) carries its state from window to window of a row,
from the learned initial state at the row's first window; a level with ``persist="sequence"``
restarts at every window (:meth:`Program.start_fast`). Then ``nll = (1/N) sum_t nll_t``,
``perplexity = exp(nll)`` and ``bits_per_byte = sum_t nll_t / ln 2 / bytes`` with ``bytes`` the
index's val ``bytes``: the UTF-8 bytes of the documents' text, which exactly the N scored tokens
decode to (an EOS decodes to none; its prediction is scored), so it compares across tokenizers.

**Perplexity by position.** Windows of L = ``max_len`` (default 4 x the trained ``seq_len`` T,
a multiple of it) of the same ``x``, the floor(N / L) complete ones, each from the learned
initial state (nothing carried: at position p the model has read exactly p + 1 tokens).
``nll(p)`` is the mean of ``nll_p`` over the windows that score position p, p = 0 .. L - 1,
reported per bucket of ``max(T // 4, 1)`` positions ``[start, end)`` (the mean over its
positions) and as ``nll_within`` (p < T, the trained length) and ``nll_beyond`` (p >= T): how
attention with RoPE past its trained length and fast-weight memories extrapolate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from nested.core.batch import off_grid
from nested.core.scheduler import Program
from nested.data import TokensTask
from nested.data.tokens import align_documents, document_ids
from nested.learn.objectives import token_cross_entropy
from nested.run.loading import Trained

SPLIT = "val"
POSITION = "position"


def make_score_fn(program: Program, eos_id: int | None = None, *, greedy: bool = False) -> Callable:
    """``(params, inputs, targets, mask, fast) -> (nll (B, T), fast)``, jitted; with ``greedy``
    ``(nll, greedy (B, T) bool, fast)``, ``greedy[b, t] = argmax(logits[b, t]) == targets[b, t]``.

    ``nll[b, t] = -log softmax(logits[b, t])[targets[b, t]]``, 0 where ``mask`` (B, T) is 0, of
    :meth:`Program.apply` over ``inputs`` (B, T) with ``targets`` and ``mask``; ``fast`` None
    starts from the learned initial states, a fast state continues it as a stream continues
    (:meth:`Program.start_fast`: persist="sequence" levels restart). With ``eos_id`` (a run
    trained with the task's ``documents``) a new document starts after each EOS, as in
    training (:func:`nested.data.tokens.document_ids`), declared on the program's
    ``document_grid`` where every start lies on it (windows of the aligned stream) and on none
    otherwise (EOS-padded choice rows). Returns the final fast state.
    """

    def score(params, inputs, targets, mask, fast, documents, grid):
        if fast is not None:
            fast = program.start_fast(params, inputs.shape[0], fast)
        logits, fast = program.apply(
            params,
            inputs,
            fast,
            targets=targets,
            mask=mask,
            documents=documents,
            document_grid=grid,
        )
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        nll = token_cross_entropy(logits, {"targets": targets, "mask": mask})
        if greedy:
            return nll, jnp.argmax(logits, axis=-1) == targets, fast
        return nll, fast

    jitted = jax.jit(score, static_argnames="grid")

    def call(params, inputs, targets, mask, fast):
        documents = None if eos_id is None else document_ids(np.asarray(inputs), eos_id)
        # Windows of the aligned stream start documents on the program's grid; the rows of
        # multiple-choice requests (EOS padded) anywhere.
        on_grid = documents is not None and off_grid(documents, program.document_grid) is None
        grid = program.document_grid if on_grid else 1
        return jitted(params, inputs, targets, mask, fast, documents, grid=grid)

    return call


def val_stream(task: TokensTask) -> np.ndarray:
    """(N,) int32: the ``val`` split's tokens, its shards concatenated."""
    return np.concatenate(task.source(SPLIT).shards).astype(np.int32)


def windows(
    stream: np.ndarray, length: int, eos: int, *, whole: bool = True, align: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x = (EOS, stream)`` as windows of ``length`` L: window w has inputs ``x[wL : wL + L]``
    and targets ``x[wL + 1 : wL + L + 1]``. ``whole``: ceil(M / L) windows of the M targets,
    the last padded with EOS past the stream (mask 0), so each of the N tokens is a target once;
    else the floor(M / L) complete ones. ``align``: ``x`` laid out by
    :func:`nested.data.tokens.align_documents` first (as the run's training windows), its pads
    masked. Returns inputs, targets (W, L) int32 and mask (W, L) float32."""
    x, real = align_documents(np.concatenate([[eos], stream]).astype(np.int32), eos, align)
    n = len(x) - 1
    count = -(-n // length) if whole else n // length
    used = min(n, count * length)
    padded = np.full(count * length + 1, eos, np.int32)
    padded[: used + 1] = x[: used + 1]
    mask = np.zeros(count * length, np.float32)
    mask[:used] = real[1 : used + 1]
    shape = (count, length)
    return padded[:-1].reshape(shape), padded[1:].reshape(shape), mask.reshape(shape)


def as_rows(arrays: Sequence[np.ndarray], rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Windows (W, L) laid out in ``rows`` B rows of K = ceil(W / B) consecutive windows: each
    array becomes (K, B, L), step k holding windows bK + k (b = 0 .. B - 1); the places past W
    hold copies of the last window. Also returns (K, B) float32: 1 where a window is real."""
    count = len(arrays[0])
    steps = -(-count // rows)
    order = np.arange(steps * rows).reshape(rows, steps).T
    real = (order < count).astype(np.float32)
    return [a[np.minimum(order, count - 1)] for a in arrays], real


def padded(arrays: Sequence[np.ndarray], rows: int) -> list[np.ndarray]:
    """Arrays (R, ...) extended to a multiple of ``rows`` rows with copies of the last row."""
    extra = -len(arrays[0]) % rows
    return [np.concatenate([a, np.repeat(a[-1:], extra, axis=0)]) for a in arrays]


def row_nll(
    trained: Trained,
    inputs: np.ndarray,
    targets: np.ndarray,
    mask: np.ndarray,
    score: Callable,
    desc: str = "perplexity",
) -> np.ndarray:
    """(B,) float64: ``sum_{k, t} nll[k, b, t]`` of K windows per row, ``inputs``, ``targets``,
    ``mask`` (K, B, L) scored in K calls of ``score`` (:func:`make_score_fn`) in turn: a level
    with ``persist="stream"`` carries its state along a row from the learned initial state at
    its first window, a ``persist="sequence"`` one restarts at every window (module
    docstring)."""
    program, params = trained.program, trained.state.params
    carried = (
        program.start_fast(params, inputs.shape[1]) if trained.experiment.carries_fast else None
    )
    total = np.zeros(inputs.shape[1], np.float64)
    for k in tqdm(range(len(inputs)), desc=desc, disable=None):
        nll, fast = score(params, inputs[k], targets[k], mask[k], carried)
        total += np.asarray(nll, np.float64).sum(axis=1)
        carried = None if carried is None else fast
    return total


def perplexity(
    trained: Trained, task: TokensTask, batch_size: int, score: Callable | None = None
) -> dict[str, Any]:
    """Perplexity and bits per byte of the whole ``val`` split (module docstring)."""
    score = score or make_score_fn(trained.program)
    length = task.split_seq_len(SPLIT)
    stream = val_stream(task)
    inputs, targets, mask = windows(stream, length, task.eos_id, align=task.align or 1)
    count = len(inputs)
    (inputs, targets, mask), real = as_rows([inputs, targets, mask], batch_size)
    mask = mask * real[..., None]  # the copies past W score nothing
    total = float(row_nll(trained, inputs, targets, mask, score).sum())
    n, size = len(stream), int(task.index["splits"][SPLIT]["bytes"])
    return {
        "tokens": n,
        "bytes": size,
        "windows": count,
        "seq_len": length,
        "rows": batch_size,
        "carried": trained.experiment.carries_fast,
        "nll": total / n,
        "perplexity": math.exp(total / n),
        "bits_per_byte": total / math.log(2) / size,
    }


def by_position(
    trained: Trained,
    task: TokensTask,
    max_len: int,
    batch_size: int,
    score: Callable | None = None,
) -> dict[str, Any]:
    """Mean nll by position in windows of ``max_len`` (module docstring)."""
    program, params = trained.program, trained.state.params
    score = score or make_score_fn(program)
    trained_len = trained.config.task.seq_len
    inputs, targets, mask = windows(
        val_stream(task), max_len, task.eos_id, whole=False, align=task.align or 1
    )
    count = len(inputs)
    inputs, targets, mask = padded([inputs, targets, mask], batch_size)
    mask[count:] = 0
    sums = np.zeros(max_len, np.float64)
    for i in tqdm(range(0, len(inputs), batch_size), desc="by position", disable=None):
        part = slice(i, i + batch_size)
        nll, _ = score(params, inputs[part], targets[part], mask[part], None)
        sums += np.asarray(nll, np.float64).sum(axis=0)
    nll = sums / np.maximum(mask.sum(axis=0), 1)  # the scored windows at each position
    width = max(trained_len // 4, 1)
    buckets = [
        {"start": s, "end": min(s + width, max_len), "nll": float(nll[s : s + width].mean())}
        for s in range(0, max_len, width)
    ]
    for bucket in buckets:
        bucket["perplexity"] = math.exp(bucket["nll"])
    out = {
        "max_len": max_len,
        "trained_len": trained_len,
        "windows": count,
        "bucket": width,
        "buckets": buckets,
        "nll_within": float(nll[:trained_len].mean()),
        "nll": [float(v) for v in nll],
    }
    if max_len > trained_len:
        out["nll_beyond"] = float(nll[trained_len:].mean())
    return out
