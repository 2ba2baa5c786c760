"""Zero-shot multiple-choice tasks of a trained language model: task files read
(:func:`read_task`), their requests encoded (:func:`make_requests`), scored
(:func:`loglikelihoods`) and reduced to accuracies (:func:`choice_metrics`).

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
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from nested.data import corpus
from nested.run.config import ConfigError
from nested.run.loading import Trained
from nested.run.perplexity import POSITION, SPLIT, make_score_fn, padded

TASK_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


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
    """The ``loglikelihood`` requests of ``examples``, one row per choice in order
    (:func:`request_arrays` of their :func:`encode_pair`). :class:`ConfigError` naming
    ``where`` for a continuation of more than T = ``length`` tokens."""
    eos = tokenizer.eos_id
    pairs = []
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
            pairs.append((context_enc, continuation_enc))
    return request_arrays(pairs, length, eos)


def request_arrays(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], length: int, eos: int
) -> dict[str, np.ndarray]:
    """``(context_enc, continuation_enc)`` pairs (continuations of 1 .. T = ``length`` tokens)
    as rows: ``inputs``, ``targets`` (R, T) int32 of ``(context_enc + continuation_enc)[-(T +
    1):]``, left-aligned and padded with EOS; ``valid`` (R, T) 1 at its tokens, ``scored`` (R,
    T) 1 at the continuation's targets."""
    shape = (len(pairs), length)
    inputs, targets = np.full(shape, eos, np.int32), np.full(shape, eos, np.int32)
    valid, scored = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for r, (context_enc, continuation_enc) in enumerate(pairs):
        tokens = (list(context_enc) + list(continuation_enc))[-(length + 1) :]
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
    *,
    greedy: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """(R,) float64: ``ll_r = -sum_t nll[r, t] scored[r, t]`` of every request, from the learned
    initial state, ``batch_size`` rows per call (the last batch padded). With ``greedy`` (and a
    ``score`` of :func:`make_score_fn` with ``greedy=True``, if given) also (R,) bool: whether
    every scored target is the argmax of its logits (the harness's ``is_greedy``)."""
    score = score or make_score_fn(trained.program, greedy=greedy)
    names = ("inputs", "targets", "valid", "scored")
    count = len(requests["inputs"])
    inputs, targets, valid, scored = padded([requests[k] for k in names], batch_size)
    lls, hits = [], []
    for i in tqdm(range(0, len(inputs), batch_size), desc="choices", disable=None):
        part = slice(i, i + batch_size)
        nll, *best, _ = score(trained.state.params, inputs[part], targets[part], valid[part], None)
        lls.append(-(np.asarray(nll, np.float64) * scored[part]).sum(axis=1))
        if greedy:
            hits.append(np.all(np.asarray(best[0]) | (scored[part] == 0), axis=1))
    lls = np.concatenate(lls)[:count]
    return (lls, np.concatenate(hits)[:count]) if greedy else lls


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
