"""Language-model evaluation of a trained run: ``evaluate_lm(workdir, ...)`` (``experiments/
eval_lm.py``): perplexity and bits per byte, perplexity by position past the trained length,
zero-shot multiple choice.

The run is a workdir of ``experiments/train.py`` trained on the task ``tokens`` (a corpus of
``experiments/prepare.py``). Text is scored on the ``val`` split of a prepared folder (the run's
``task.path``, or ``data``: a folder of the same tokenizer) by the run's own
:meth:`nested.core.scheduler.Program.apply`, given the targets and the mask of real tokens as the
training loss gives them (so levels that learn from the outer loss learn in context as there),
the per-token negative log-likelihood ``nll_t = -log softmax(logits_t)[target_t]``
(:func:`nested.learn.objectives.token_cross_entropy`, the terms of the training loss) in nats.

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

**Zero-shot multiple choice** with the ``loglikelihood`` semantics of EleutherAI
lm-evaluation-harness (``TemplateLM.loglikelihood`` / ``_encode_pair``, HFLM's
``_loglikelihood_tokens``, ``ConfigurableTask.process_results`` of ``multiple_choice``). A task
file is JSONL, one object per line (blank lines skipped)::

    {"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}

``context`` a string, ``choices`` two or more non-empty strings, each the continuation as scored
(its leading space included), ``answer`` the index of the right one. Per choice: trailing
whitespace of the context moves to the start of the continuation, then ``context_enc =
enc(context)``, ``whole = enc(context + continuation)``, ``continuation_enc =
whole[len(context_enc):]``; an empty context is the EOS token (the harness's prefix token). The
model reads ``(context_enc + continuation_enc)[-(T + 1):][:-1]`` (the context cut from the left
to fit T, the trained ``seq_len``) from the learned initial state, and ``ll_i = sum log p(token
| preceding)`` over the continuation's tokens. Per example ``acc = [argmax_i ll_i == answer]``,
``acc_norm = [argmax_i ll_i / chars_i == answer]`` with ``chars_i`` the choice's length in
characters (the harness's ``acc_norm``: ``len(choice)``) and ``acc_bytes`` with its length in
UTF-8 bytes (the harness's ``acc_bytes``); each is the mean over examples. (The harness's
lengths exclude its ``target_delimiter``, here part of the choice.) Requests are scored
``batch_size`` at a time, padded to T with EOS and masked, so one compilation serves them all.

**Output.** ``eval_lm.json`` in the workdir (or ``out``), a printed table, and the scalars at
the checkpoint's step through :class:`nested.run.metrics.MetricWriter` in ``<workdir>/eval_lm``
(``metrics.jsonl`` and TensorBoard ``<section>/<metric>``; sections ``val``, ``position`` and one
per task), apart from the run's own metrics.

**Bad input** raises :class:`nested.run.config.ConfigError` (or
:class:`nested.run.checkpoint.CheckpointError`) with one line naming the problem and the fix,
before anything is compiled: a workdir without a run or a checkpoint, a run not trained on the
task ``tokens``, a data folder that is not a prepared corpus or whose tokenizer is not the
run's, a ``max_len`` that is not a multiple of T, a task file that is missing, not JSONL, lacks
a field, has an answer out of range, a continuation longer than T tokens, or no example.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from nested import files
from nested.core.scheduler import Program
from nested.data import TokensTask, corpus
from nested.data.batch import off_grid
from nested.data.tokens import align_documents, document_ids
from nested.learn.objectives import token_cross_entropy
from nested.run import checkpoint, metrics, rundir
from nested.run import config as config_lib
from nested.run.config import ConfigError
from nested.run.loading import Trained

RESULTS_FILE = "eval_lm.json"
METRICS_DIR = "eval_lm"  # <workdir>/eval_lm: the MetricWriter's metrics.jsonl and TensorBoard
SPLIT = "val"
POSITION = "position"
TASK_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# -- scoring ----------------------------------------------------------------------------------


def make_score_fn(program: Program, eos_id: int | None = None) -> Callable:
    """``(params, inputs, targets, mask, fast) -> (nll (B, T), fast)``, jitted.

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
        return token_cross_entropy(logits, {"targets": targets, "mask": mask}), fast

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


def _padded(arrays: Sequence[np.ndarray], rows: int) -> list[np.ndarray]:
    """Arrays (R, ...) extended to a multiple of ``rows`` rows with copies of the last row."""
    extra = -len(arrays[0]) % rows
    return [np.concatenate([a, np.repeat(a[-1:], extra, axis=0)]) for a in arrays]


def perplexity(
    trained: Trained, task: TokensTask, batch_size: int, score: Callable | None = None
) -> dict[str, Any]:
    """Perplexity and bits per byte of the whole ``val`` split (module docstring)."""
    program, params = trained.program, trained.state.params
    score = score or make_score_fn(program)
    length = task.split_seq_len(SPLIT)
    stream = val_stream(task)
    inputs, targets, mask = windows(stream, length, task.eos_id, align=task.align or 1)
    count = len(inputs)
    (inputs, targets, mask), real = as_rows([inputs, targets, mask], batch_size)
    mask = mask * real[..., None]  # the copies past W score nothing
    carries = trained.experiment.carries_fast
    carried = program.start_fast(params, batch_size) if carries else None
    total = 0.0
    for k in tqdm(range(len(inputs)), desc="perplexity", disable=None):
        nll, fast = score(params, inputs[k], targets[k], mask[k], carried)
        total += float(np.sum(np.asarray(nll, np.float64)))
        carried = None if carried is None else fast
    n, size = len(stream), int(task.index["splits"][SPLIT]["bytes"])
    return {
        "tokens": n,
        "bytes": size,
        "windows": count,
        "seq_len": length,
        "rows": batch_size,
        "carried": carries,
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
    inputs, targets, mask = _padded([inputs, targets, mask], batch_size)
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


# -- multiple choice --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
    """One multiple-choice question of a task file."""

    context: str
    choices: tuple[str, ...]
    answer: int


def parse_tasks(specs: Sequence[str]) -> dict[str, Path]:
    """``["name=path.jsonl", ...]`` (``--tasks``) as ``{name: path}``; :class:`ConfigError` for
    an entry that is not ``name=path``, a bad or repeated name."""
    tasks = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path or not TASK_NAME.match(name) or name in (SPLIT, POSITION):
            raise ConfigError(
                f"--tasks: {spec!r} is not name=path.jsonl with a name of letters, digits, "
                f"'_', '.', '-' (not {SPLIT!r} or {POSITION!r}); e.g. --tasks=copa=data/copa.jsonl"
            )
        if name in tasks:
            raise ConfigError(f"--tasks: the name {name!r} is given twice; name each task once")
        tasks[name] = Path(path)
    return tasks


def read_task(path: str | Path) -> list[Example]:
    """The examples of the JSONL task file ``path`` (module docstring); :class:`ConfigError`
    naming the file and line of the first bad one."""
    path = Path(path)
    fix = 'each line one {"context": str, "choices": [str, ...], "answer": int}'
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"task file {path}: no such file; give an existing .jsonl") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"task file {path}: cannot be read as UTF-8 text ({error})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"task file {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{where}: not JSON ({error.msg}); {fix}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; {fix}")
        context, choices, answer = (record.get(k) for k in ("context", "choices", "answer"))
        if not isinstance(context, str):
            raise ConfigError(f"{where}: no string 'context'; {fix}")
        if (
            not isinstance(choices, list)
            or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise ConfigError(f"{where}: 'choices' is not a list of 2 or more non-empty strings")
        if not isinstance(answer, int) or isinstance(answer, bool):
            raise ConfigError(f"{where}: no int 'answer' (the index of the right choice)")
        if not 0 <= answer < len(choices):
            raise ConfigError(
                f"{where}: answer={answer} is out of range for {len(choices)} choices; use "
                f"0 .. {len(choices) - 1}"
            )
        examples.append(Example(context, tuple(choices), answer))
    if not examples:
        raise ConfigError(f"task file {path}: no examples; {fix}")
    return examples


def encode_pair(
    encode: Callable[[str], Sequence[int]], eos: int, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """``(context_enc, continuation_enc)`` as the harness's ``_encode_pair``: the context's
    trailing whitespace moved to the continuation, ``whole = enc(context + continuation)``,
    ``continuation_enc = whole[len(enc(context)):]``; an empty context is ``[eos]``."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_enc = [int(t) for t in encode(context)]
    whole = [int(t) for t in encode(context + continuation)]
    return context_enc or [eos], whole[len(context_enc) :]


def make_requests(
    examples: Sequence[Example], tokenizer: corpus.Tokenizer, length: int, where: str
) -> dict[str, np.ndarray]:
    """The ``loglikelihood`` requests of ``examples``, one row per choice in order: ``inputs``,
    ``targets`` (R, T = ``length``) int32 of ``(context_enc + continuation_enc)[-(T + 1):]``,
    left-aligned and padded with EOS; ``valid`` (R, T) 1 at its tokens, ``scored`` (R, T) 1 at
    the continuation's targets. :class:`ConfigError` naming ``where`` for a continuation of
    more than T tokens."""
    eos = tokenizer.eos_id
    rows = []
    for i, example in enumerate(examples):
        for j, choice in enumerate(example.choices):
            context_enc, continuation_enc = encode_pair(
                tokenizer.encode, eos, example.context, choice
            )
            if not 0 < len(continuation_enc) <= length:
                raise ConfigError(
                    f"{where}: example {i + 1}, choice {j}: the continuation is "
                    f"{len(continuation_enc)} tokens, not 1 .. {length} (the trained seq_len); "
                    "shorten the choice"
                )
            rows.append((context_enc, continuation_enc))
    shape = (len(rows), length)
    inputs, targets = np.full(shape, eos, np.int32), np.full(shape, eos, np.int32)
    valid, scored = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for r, (context_enc, continuation_enc) in enumerate(rows):
        tokens = (context_enc + continuation_enc)[-(length + 1) :]
        n = len(tokens) - 1
        inputs[r, :n], targets[r, :n] = tokens[:-1], tokens[1:]
        valid[r, :n] = 1.0
        scored[r, n - len(continuation_enc) : n] = 1.0
    return {"inputs": inputs, "targets": targets, "valid": valid, "scored": scored}


def loglikelihoods(
    trained: Trained,
    requests: Mapping[str, np.ndarray],
    batch_size: int,
    score: Callable | None = None,
) -> np.ndarray:
    """(R,) float64: ``ll_r = -sum_t nll[r, t] scored[r, t]`` of every request, from the learned
    initial state, ``batch_size`` rows per call (the last batch padded)."""
    score = score or make_score_fn(trained.program)
    names = ("inputs", "targets", "valid", "scored")
    count = len(requests["inputs"])
    inputs, targets, valid, scored = _padded([requests[k] for k in names], batch_size)
    out = []
    for i in tqdm(range(0, len(inputs), batch_size), desc="choices", disable=None):
        part = slice(i, i + batch_size)
        nll, _ = score(trained.state.params, inputs[part], targets[part], valid[part], None)
        out.append(-(np.asarray(nll, np.float64) * scored[part]).sum(axis=1))
    return np.concatenate(out)[:count]


def choice_metrics(examples: Sequence[Example], lls: np.ndarray) -> dict[str, Any]:
    """``acc``, ``acc_norm`` (per character) and ``acc_bytes`` (per UTF-8 byte) of ``examples``
    given the loglikelihoods ``lls`` of their choices in order (module docstring), and the
    loglikelihoods per example."""
    hits = {"acc": [], "acc_norm": [], "acc_bytes": []}
    per_example, start = [], 0
    for example in examples:
        ll = lls[start : start + len(example.choices)]
        start += len(example.choices)
        chars = np.array([len(c) for c in example.choices], np.float64)
        size = np.array([len(c.encode("utf-8")) for c in example.choices], np.float64)
        for name, value in (("acc", ll), ("acc_norm", ll / chars), ("acc_bytes", ll / size)):
            hits[name].append(float(np.argmax(value) == example.answer))
        per_example.append([float(v) for v in ll])
    out = {name: float(np.mean(values)) for name, values in hits.items()}
    return {"examples": len(examples), **out, "loglikelihoods": per_example}


# -- checks before compiling ------------------------------------------------------------------


def _tokenizer_identity(index: Mapping[str, Any]) -> tuple:
    tok = index["tokenizer"]
    return tok["sha256"], tok["eos_id"], tok["vocab_size"]


def eval_task(config_task: TokensTask, data: str | Path | None) -> TokensTask:
    """The run's task on the folder ``data`` (None: its own ``task.path``), checked: a prepared
    corpus with a ``val`` window, of the run's tokenizer (the one of ``task.tokenizer_sha256``
    where set, and that of the folder it trained on, where that folder is still readable)."""
    where = "--data" if data is not None else "the run's task.path"
    task = config_task if data is None else dataclasses.replace(config_task, path=str(data))
    try:
        index = task.index
        task.source(SPLIT)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None
    if data is not None and config_task.path is not None:
        try:
            trained_index = config_task.index
        except ValueError:
            return task  # the training folder is gone: the vocabulary check above is all
        if _tokenizer_identity(trained_index) != _tokenizer_identity(index):
            tok, ours = index["tokenizer"], trained_index["tokenizer"]
            fix = (
                "bytes"
                if ours["kind"] == "bytes"
                else Path(config_task.path) / corpus.TOKENIZER_FILE
            )
            raise ConfigError(
                f"--data {data}: its shards come from another tokenizer ({tok['kind']}, "
                f"sha256={tok['sha256']}, vocab {tok['vocab_size']}) than the run's corpus "
                f"{config_task.path} ({ours['kind']}, sha256={ours['sha256']}, vocab "
                f"{ours['vocab_size']}); prepare it with experiments/prepare.py --tokenizer={fix}"
            )
    return task


def _check_checkpoint(directory: Path) -> None:
    if not any(p.name.isdigit() for p in directory.iterdir()):
        raise checkpoint.CheckpointError(
            f"no checkpoint in {directory}: the run saved none yet; train it until it saves one "
            "(train.checkpoint_every, or the end of the run)"
        )


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--{name}={value!r}: use a positive int")
    return value


# -- the whole evaluation ---------------------------------------------------------------------


def evaluate_lm(
    workdir: str | Path,
    *,
    data: str | Path | None = None,
    tasks: Mapping[str, str | Path] | None = None,
    max_len: int | None = None,
    batch_size: int | None = None,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate the latest checkpoint of ``workdir`` (module docstring) and return the results
    written to ``out`` (default ``<workdir>/eval_lm.json``).

    ``data``: a prepared folder to score instead of the run's ``task.path``; ``tasks``: ``{name:
    task file}`` of multiple-choice tasks; ``max_len``: the window of perplexity by position
    (default 4 x the trained ``seq_len``); ``batch_size``: rows per call (default
    ``train.eval_batch_size``). Everything is checked before anything is compiled.
    """
    workdir = Path(workdir)
    directory = rundir.check_run(workdir)
    _check_checkpoint(directory)
    exp = config_lib.build(rundir.load_workdir_config(workdir))
    if not isinstance(exp.task, TokensTask):
        raise ConfigError(
            f"--workdir {workdir}: the run trained on the task {exp.task.name!r}; eval_lm "
            "evaluates language models of the task 'tokens' (use experiments/eval.py)"
        )
    task = eval_task(exp.task, data)
    seq_len = exp.config.task.seq_len
    max_len = 4 * seq_len if max_len is None else _positive("max_len", max_len)
    batch_size = exp.config.train.eval_batch_size if batch_size is None else batch_size
    _positive("batch_size", batch_size)
    if max_len % seq_len:
        raise ConfigError(
            f"--max_len={max_len} is not a multiple of the trained seq_len {seq_len}; use e.g. "
            f"{4 * seq_len}"
        )
    tokens = task.index["splits"][SPLIT]["tokens"]
    if tokens < max_len:
        raise ConfigError(
            f"--max_len={max_len}: the val split of {task.path} has {tokens} tokens, fewer than "
            f"one window; lower --max_len (a multiple of {seq_len}) or use a larger val split"
        )
    requests = {}
    if tasks:
        try:
            tokenizer = corpus.prepared_tokenizer(task.path, task.index)
        except corpus.PrepareError as error:
            raise ConfigError(str(error)) from None
        for name, path in tasks.items():
            examples = read_task(path)
            where = f"task {name} ({path})"
            requests[name] = (examples, make_requests(examples, tokenizer, seq_len, where))

    restored = rundir.restore_latest(exp, directory)
    trained = Trained(exp, restored.state, restored.step)
    score = make_score_fn(exp.program, task.eos_id if task.documents else None)
    result = {
        "workdir": str(workdir),
        "step": trained.step,
        "data": str(task.path),
        "tokenizer": task.index["tokenizer"]["kind"],
        SPLIT: perplexity(trained, task, batch_size, score),
        POSITION: by_position(trained, task, max_len, batch_size, score),
        "tasks": {},
    }
    for name, (examples, made) in requests.items():
        lls = loglikelihoods(trained, made, batch_size, score)
        result["tasks"][name] = {"path": str(tasks[name]), **choice_metrics(examples, lls)}

    out = workdir / RESULTS_FILE if out is None else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(out, json.dumps(result, indent=2) + "\n")
    write_scalars(workdir / METRICS_DIR, result)
    print(format_results(result))
    print(f"results: {out}")
    return result


def scalars(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{section: {metric: value}}`` of ``result``: the headline numbers."""
    ppl, pos = result[SPLIT], result[POSITION]
    out = {
        SPLIT: {k: ppl[k] for k in ("nll", "perplexity", "bits_per_byte")},
        POSITION: {k: pos[k] for k in ("nll_within", "nll_beyond") if k in pos},
    }
    out[POSITION].update({f"nll_from_{b['start']}": b["nll"] for b in pos["buckets"]})
    for name, values in result["tasks"].items():
        out[name] = {k: values[k] for k in ("acc", "acc_norm", "acc_bytes")}
    return out


def write_scalars(directory: Path, result: Mapping[str, Any]) -> None:
    """The :func:`scalars` of ``result`` at its step, through the run's metric writer into
    ``directory`` (its ``metrics.jsonl``, replaced, and TensorBoard)."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = metrics.MetricWriter(directory)
    try:
        for section, values in scalars(result).items():
            writer.write(result["step"], section, values)
    finally:
        writer.close()


def format_results(result: Mapping[str, Any]) -> str:
    """The printed table of ``result``."""
    ppl, pos = result[SPLIT], result[POSITION]
    lines = [
        f"eval_lm at step {result['step']} on {result['data']} ({result['tokenizer']} tokenizer)",
        f"  val: {ppl['tokens']} tokens, {ppl['bytes']} bytes, {ppl['windows']} windows of "
        f"{ppl['seq_len']}: nll {ppl['nll']:.4f}  perplexity {ppl['perplexity']:.4f}  "
        f"bits/byte {ppl['bits_per_byte']:.4f}",
        f"  by position ({pos['windows']} windows of {pos['max_len']}, trained "
        f"{pos['trained_len']}):",
        f"    {'positions':>13}  {'nll':>8}  {'perplexity':>10}",
    ]
    for b in pos["buckets"]:
        if b["start"] == pos["trained_len"]:
            lines.append(f"    {'-- beyond the trained length --':>35}")
        span = f"{b['start']}-{b['end'] - 1}"
        lines.append(f"    {span:>13}  {b['nll']:8.4f}  {b['perplexity']:10.4f}")
    if result["tasks"]:
        width = max(len(n) for n in (*result["tasks"], "task"))
        lines.append(f"  {'task':<{width}}  examples     acc  acc_norm  acc_bytes")
        for name, r in result["tasks"].items():
            cells = (
                f"{r['examples']:>8}  {r['acc']:6.4f}  {r['acc_norm']:8.4f}  {r['acc_bytes']:9.4f}"
            )
            lines.append(f"  {name:<{width}}  {cells}")
    return "\n".join(lines)
