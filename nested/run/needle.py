"""RULER's single-needle tasks for a trained language model: ``niah_single_1`` (the needle in
repeated noise) and ``niah_single_2`` (in real text), by context length
(:func:`needle_metrics`, run by ``experiments/eval_lm.py --needle``).

After Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654, and its code (NVIDIA/RULER, ``scripts/synthetic.yaml``: both tasks
have one word key and one number value; ``scripts/data/synthetic/niah.py`` and ``constants.py``
for the text; ``scripts/eval/synthetic/constants.py`` for the score). A sample is a key
``adjective-noun`` (:data:`ADJECTIVES` x :data:`NOUNS`), a 7-digit value and a depth; its
prompt, with RULER's base template worded for one needle, is::

    A special magic number is hidden within the following text. Make sure to memorize it. I
    will quiz you about the number afterwards.\\n<haystack with the needle at the depth>\\nWhat
    is the special magic number for <key> mentioned in the provided text? The special magic
    number for <key> mentioned in the provided text is

and the needle is ``One of the special magic numbers for <key> is: <value>.``. The haystack of
``niah_single_1`` is :data:`NOISE` repeated, one line each, the needle a line of its own (as
RULER's ``noise`` haystack); that of ``niah_single_2`` is the run's corpus in place of Paul
Graham's essays: a slice of its ``val`` split from a random place, its documents' EOS removed,
the needle after a token that ends a sentence (``.``, ``!``, ``?`` or a newline, as RULER
inserts between sentences).

**Lengths.** Built in token ids, a prompt of context length L is exactly ``L - new_tokens``
tokens (RULER's ``max_seq_length`` counts the ``tokens_to_generate`` too): the haystack is cut
to fit (the noise's first line, the text's end), and the needle goes at the line or sentence
boundary nearest to ``depth x H`` (H: the haystack's tokens); the depth reported is the one
reached. The prompt starts as a document
starts in training: after an EOS, read as a token by a run trained without ``task.documents``
and a restart (so the learned initial state, without it) with them; it holds no other EOS, so
nothing restarts inside it. Sample i of ``count`` sits at depth ``i / (count - 1)``, swept
through the context; its key, value and text place depend on (seed, i) only, so every length
asks the same questions.

**Score.** The continuation is generated greedily (:func:`nested.run.sampling.generate`, rows
of equal length ``batch_size`` at a time, stopping at EOS) for ``new_tokens`` tokens (RULER:
128) and decoded; a sample is right when the decoded text contains the value (RULER's
``string_match_all`` of one reference: ``value.lower() in text.lower()``). Accuracy per task
and length, with its Wilson score 95% interval over the samples (:func:`wilson`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from nested.data import corpus
from nested.run import sampling
from nested.run.config import ConfigError
from nested.run.loading import Trained

TASKS = ("niah_single_1", "niah_single_2")
LENGTHS = (1024, 2048, 4096, 8192)
NEW_TOKENS = 32  # generated tokens (RULER: 128); enough for the value in a BPE or in bytes
HEAD = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n"
)
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SENTENCE_ENDS = (".", "!", "?", "\n")
# Keys are adjective-noun pairs, as RULER's (which draws them from the wonderwords lists).
ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "crooked", "curious", "damp", "eager",
    "faint", "fancy", "gentle", "glossy", "hollow", "humble", "icy", "jolly", "lively",
    "lucky", "mighty", "noisy", "odd", "pale", "proud", "quiet", "rapid", "rusty", "silent",
    "sticky", "tidy", "vivid", "wild",
)  # fmt: skip
NOUNS = (
    "anchor", "badge", "basket", "beacon", "blanket", "bucket", "candle", "canyon", "castle",
    "comet", "compass", "cottage", "engine", "falcon", "feather", "garden", "harbor",
    "helmet", "island", "kettle", "lantern", "meadow", "mirror", "orchard", "pebble",
    "pillow", "planet", "ribbon", "saddle", "teapot", "violin", "wagon",
)  # fmt: skip


def parse_lengths(specs: Sequence[str]) -> tuple[int, ...]:
    """``["1024", "2K", ...]`` (``--needle_lengths``) as ints (``K``: x 1024); :class:`ConfigError`
    for anything else."""
    out = []
    for spec in specs:
        digits, kilo = (spec[:-1], 1024) if spec[-1:] in "kK" and spec[:-1] else (spec, 1)
        if not digits.isdigit() or int(digits) < 1:
            raise ConfigError(
                f"--needle_lengths: {spec!r} is not a positive number of tokens; e.g. "
                "--needle_lengths=1024,2048 or 1K,2K"
            )
        out.append(int(digits) * kilo)
    return tuple(out)


class Sample(NamedTuple):
    """One question: its ``key``, ``value`` (7 digits) and ``depth`` in [0, 1]."""

    key: str
    value: str
    depth: float


class Prompt(NamedTuple):
    """A built prompt: ``tokens`` (L - new_tokens,) int32, ``needle`` the index of its first
    needle token, ``depth`` the fraction of the haystack's tokens before the needle."""

    tokens: np.ndarray
    needle: int
    depth: float


def samples(count: int, seed: int = 0) -> list[Sample]:
    """``count`` samples: sample i at depth ``i / (count - 1)`` (0.5 alone), its key and value
    drawn from (seed, i)."""
    out = []
    for i in range(count):
        rng = np.random.default_rng((seed, i))
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        depth = i / (count - 1) if count > 1 else 0.5
        out.append(Sample(key, str(rng.integers(10**6, 10**7)), depth))
    return out


def haystack_stream(tokens: np.ndarray, eos: int) -> np.ndarray:
    """The ``val`` split's tokens (N,) with their EOS removed: the documents as one text."""
    return tokens[tokens != eos].astype(np.int32)


def sentence_ends(tokenizer: corpus.Tokenizer) -> np.ndarray:
    """(V,) bool: whether token id's text ends a sentence (:data:`SENTENCE_ENDS`, trailing
    spaces aside)."""
    texts = (tokenizer.decode([i]).rstrip(" ") for i in range(tokenizer.vocab_size))
    return np.array([text.endswith(SENTENCE_ENDS) for text in texts], bool)


def _encode(tokenizer: corpus.Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), np.int32)


def haystack_size(
    tokenizer: corpus.Tokenizer,
    task: str,
    sample: Sample,
    length: int,
    new_tokens: int,
    prefix: int,
) -> int:
    """H: the haystack's tokens in a prompt of context length ``length``, the rest being
    ``prefix`` (0 or 1 EOS), the head, the needle, the question and ``new_tokens``."""
    parts = _parts(tokenizer, task, sample)
    return length - new_tokens - prefix - sum(len(part) for part in parts.values())


def _parts(tokenizer: corpus.Tokenizer, task: str, sample: Sample) -> dict[str, np.ndarray]:
    needle = NEEDLE.format(key=sample.key, value=sample.value)
    needle = needle + "\n" if task == "niah_single_1" else " " + needle
    return {
        "head": _encode(tokenizer, HEAD),
        "needle": _encode(tokenizer, needle),
        "question": _encode(tokenizer, QUESTION.format(key=sample.key)),
    }


def build_prompt(
    tokenizer: corpus.Tokenizer,
    task: str,
    sample: Sample,
    length: int,
    *,
    new_tokens: int = NEW_TOKENS,
    prefix: Sequence[int] = (),
    text: np.ndarray | None = None,
    ends: np.ndarray | None = None,
) -> Prompt:
    """The prompt of ``sample`` for ``task`` at context length ``length`` (module docstring):
    ``prefix`` (``[EOS]`` or nothing), the head, the haystack with the needle, the question;
    ``length - new_tokens`` tokens. ``niah_single_2`` takes ``text``, the haystack's tokens
    (at least H), and ``ends``, :func:`sentence_ends` of the tokenizer. :class:`ConfigError`
    when the length leaves no room for a haystack."""
    if task not in TASKS:
        raise ConfigError(f"--needle: no task {task!r}; use some of {list(TASKS)}")
    parts = _parts(tokenizer, task, sample)
    size = haystack_size(tokenizer, task, sample, length, new_tokens, len(prefix))
    if size < 1:
        raise ConfigError(
            f"--needle_lengths={length}: the template, needle, question and the {new_tokens} "
            f"generated tokens take {length - size + 1} tokens or more; use longer lengths"
        )
    if task == "niah_single_1":
        line = np.concatenate([_encode(tokenizer, NOISE), _encode(tokenizer, "\n")])
        haystack = np.tile(line, -(-size // len(line)))[-size:]  # the first line cut
        boundaries = np.unique(np.concatenate([[0], np.arange(size, -1, -len(line))]))
    else:
        if text is None or len(text) < size or ends is None:
            raise ValueError(f"niah_single_2 needs text of {size} tokens or more, and ends")
        haystack = text[:size]
        boundaries = np.concatenate([[0], np.flatnonzero(ends[haystack]) + 1])
    at = int(boundaries[np.argmin(np.abs(boundaries - sample.depth * size))])
    tokens = np.concatenate(
        [
            np.asarray(prefix, np.int32),
            parts["head"],
            haystack[:at],
            parts["needle"],
            haystack[at:],
            parts["question"],
        ]
    ).astype(np.int32)
    return Prompt(tokens, len(prefix) + len(parts["head"]) + at, at / size)


def string_match(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all`` of one prediction: the fraction of ``references`` it
    contains, ignoring case."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def wilson(correct: int, count: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``correct / count`` (95% at the
    default ``z``): ``(c -+ h) / (1 + z^2 / n)``, ``c = p + z^2 / 2n``, ``h = z sqrt(p (1 - p) /
    n + z^2 / 4n^2)``."""
    p, n = correct / count, count
    center = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max((center - half) / (1 + z * z / n), 0.0), min((center + half) / (1 + z * z / n), 1.0)


class Request(NamedTuple):
    """The prompts of one task and length: ``prompts`` (R, L - new_tokens) int32, their samples
    and reached depths."""

    task: str
    length: int
    prompts: np.ndarray
    samples: list[Sample]
    depths: list[float]


def make_requests(
    tokenizer: corpus.Tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    count: int,
    *,
    documents: bool,
    val_tokens: np.ndarray,
    where: str,
    new_tokens: int = NEW_TOKENS,
    seed: int = 0,
) -> list[Request]:
    """Every task's prompts at every length (module docstring), built and checked before
    anything compiles: :class:`ConfigError` for an unknown task, a length too short for the
    template or longer than the ``val_tokens`` of ``where`` (a prepared corpus) can fill."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"--needle: no task {unknown}; use some of {list(TASKS)}")
    prefix = () if documents else (tokenizer.eos_id,)
    chosen = samples(count, seed)
    text = haystack_stream(val_tokens, tokenizer.eos_id)
    ends = sentence_ends(tokenizer) if "niah_single_2" in tasks else None
    requests = []
    for task in tasks:
        for length in lengths:
            built = []
            for i, sample in enumerate(chosen):
                size = haystack_size(tokenizer, task, sample, length, new_tokens, len(prefix))
                start = 0
                if task == "niah_single_2":
                    if size > len(text):
                        raise ConfigError(
                            f"--needle_lengths={length}: niah_single_2 needs a haystack of "
                            f"{size} tokens, the val split of {where} has {len(text)} (EOS "
                            "removed); use shorter lengths or a corpus with a larger val split"
                        )
                    start = int(np.random.default_rng((seed, i, 1)).integers(len(text) - size + 1))
                built.append(
                    build_prompt(
                        tokenizer,
                        task,
                        sample,
                        length,
                        new_tokens=new_tokens,
                        prefix=prefix,
                        text=text[start:],
                        ends=ends,
                    )
                )
            prompts = np.stack([p.tokens for p in built])
            requests.append(Request(task, length, prompts, chosen, [p.depth for p in built]))
    return requests


def continuations(
    trained: Trained, prompts: np.ndarray, new_tokens: int, batch_size: int, eos: int
) -> list[list[int]]:
    """The greedy continuations of ``prompts`` (R, P), each up to its EOS (excluded), generated
    ``batch_size`` rows at a time (the last batch padded with copies of its last row)."""
    program, params = trained.program, trained.state.params
    count = len(prompts)
    rows = np.concatenate([prompts, np.repeat(prompts[-1:], -count % batch_size, axis=0)])
    out = []
    for start in range(0, len(rows), batch_size):
        sample = sampling.generate(
            program,
            params,
            rows[start : start + batch_size],
            max_new_tokens=new_tokens,
            stop=[eos],
        )
        tokens = np.asarray(sample.tokens)
        for row, n in zip(tokens, sample.lengths, strict=True):
            row = row[:n].tolist()
            out.append(row[: row.index(eos)] if eos in row else row)
    return out[:count]


def needle_metrics(
    trained: Trained,
    tokenizer: corpus.Tokenizer,
    requests: Sequence[Request],
    batch_size: int,
    new_tokens: int = NEW_TOKENS,
) -> dict[str, Any]:
    """``{task: {"lengths": {L: result}}}`` of ``requests``: per length the samples, the right
    ones, the accuracy and its Wilson 95% interval, and per sample its depth, hit and
    decoded continuation."""
    out: dict[str, Any] = {}
    for request in tqdm(requests, desc="needle", disable=None):
        made = continuations(trained, request.prompts, new_tokens, batch_size, tokenizer.eos_id)
        texts = [tokenizer.decode(tokens) for tokens in made]
        hits = [string_match(t, [s.value]) for t, s in zip(texts, request.samples, strict=True)]
        correct = int(sum(hits))
        low, high = wilson(correct, len(hits))
        out.setdefault(request.task, {"new_tokens": new_tokens, "lengths": {}})
        out[request.task]["lengths"][str(request.length)] = {
            "samples": len(hits),
            "correct": correct,
            "accuracy": correct / len(hits),
            "low": low,
            "high": high,
            "prompt_tokens": int(request.prompts.shape[1]),
            "depths": request.depths,
            "hits": hits,
            "predictions": texts,
        }
    return out
