"""A trained run as an EleutherAI lm-evaluation-harness model: ``nested``.

``import nested.run.harness`` registers :class:`NestedLM` as the harness model ``nested``, so
``lm_eval.simple_evaluate(model="nested", model_args="workdir=runs/x", tasks=[...])`` evaluates
the latest checkpoint of ``runs/x``. The harness (``lm_eval`` 0.4.13) finds models only in its
own registry, filled on import, and reads no entry point group of other packages; so its
command line is ``python -m nested.run.harness`` (:func:`main`: this registration, then the
harness's own ``lm_eval`` command line, every argument as there)::

    python -m nested.run.harness --model nested --model_args workdir=runs/x --batch_size 8 \\
        --tasks wikitext,lambada_openai,piqa

``model_args``: ``workdir`` (a run of ``experiments/train.py`` on the task ``tokens``),
``step`` (its checkpoint of that step; default the latest readable one), ``batch_size`` (rows
per call; default ``train.eval_batch_size``; on the command line the harness's own
``--batch_size``, default 1), ``max_length`` (default below), ``tokenizer`` (``bytes`` or a
``tokenizer.json``; default the run's corpus's: its ``tokenizer.json``, or bytes for a bytes
corpus), ``max_gen_toks`` (default 256) and ``seed`` (of sampled generations). Text becomes
token ids with that tokenizer; EOS (what precedes a document in training) is the harness's
prefix token, and an EOS inside a text (a BPE's ``<|endoftext|>``) starts a new document.
Tasks read from a hub need it, or its datasets in the local cache with
``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``.

**loglikelihood** ``(context, continuation)``: as ``eval_lm``'s multiple-choice tasks
(:mod:`nested.run.choice`: the harness's ``_encode_pair``, the context cut from the left so
that T + 1 tokens remain, T = ``max_length``, default the trained ``seq_len``), from the learned
initial state; returns the continuation's summed log-probability and whether each of its tokens
is the argmax (``is_greedy``).

**loglikelihood_rolling** ``(text,)``: the text scored as ``eval_lm`` scores its val split
(:mod:`nested.run.perplexity`): ``x = (EOS, enc(text))`` in windows of L = ``max_length``
(default the run's val length), every token a target once, documents restarting after each
EOS, laid out as the run's training windows (``task.align``); a ``persist="stream"`` level
carries its state from window to window of the text, a ``persist="sequence"`` one restarts at
every window, as in training. (The harness's Hugging Face models score each window afresh, the
last one with a full context of L tokens.) Returns ``sum_t log p`` over the text's tokens.

**generate_until** ``(context, {"until", "max_gen_toks", "do_sample", "temperature",
"top_k"})``: :func:`nested.run.sampling.generate` from the context's last ``max_length -
max_gen_toks`` tokens (at least one), greedy unless ``do_sample`` with a ``temperature`` > 0;
it never emits an id the tokenizer lacks (their logits are -inf), stops at EOS and at any
``until`` string of one token, and returns the decoded text cut before the first ``until``
string. The prompt is read as one document.

**Batches.** Requests are scored ``batch_size`` rows per call at fixed shapes (B, T) or (B, L),
the last batch padded with masked copies, so each kind compiles once (twice where documents
lie on the program's ``document_grid`` in some rows only). Generations run in groups of equal
prompt length and settings, rows padded to a power of two, prompts read in pieces of ``2^j P``
tokens (P: :func:`nested.run.sampling.stream_period`), so the prefill compiles once per piece
size; a prompt of n <= P last tokens starts the sampler (the whole prompt, for a model attending
to the whole stream: :func:`nested.run.sampling.whole_stream_layers`).

**Bad input** raises :class:`nested.run.config.ConfigError` naming the ``model_args`` field or
the request and the fix, before anything is compiled where it can be.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import lm_eval.models  # noqa: F401  (the harness's own models stay registered beside ours)
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from nested.core.scheduler import Program
from nested.data import TokensTask, corpus
from nested.run import choice, cli, perplexity, rundir, sampling
from nested.run import config as config_lib
from nested.run.config import ConfigError, Experiment
from nested.run.loading import Trained

MAX_GEN_TOKS = 256  # the harness's default for HF models
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k")
MODEL_ARGS = ("workdir", "step", "batch_size", "max_length", "tokenizer", "max_gen_toks", "seed")


def _count(name: str, value: Any, low: int = 1, where: str = "model_args") -> int:
    """``value`` (an int or its digits, as model_args give them) as an int >= ``low``."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where} {name}={value!r}: use an int >= {low}")
    return int(value)


def run_tokenizer(experiment: Experiment, tokenizer: str | None = None) -> corpus.Tokenizer:
    """The tokenizer of the run's corpus, or ``tokenizer``: ``"bytes"`` or the path of a
    ``tokenizer.json`` (:func:`nested.data.corpus.run_tokenizer`); :class:`ConfigError` naming
    ``model_args`` when there is none, it is unreadable, not the run's, or too large."""
    task = experiment.task
    where = f"tokenizer={tokenizer}" if tokenizer else f"the run's task ({task.name}) tokenizer"
    fix = (
        "pass model_args tokenizer=bytes or tokenizer=<the tokenizer.json the run's corpus was "
        "prepared with>"
    )
    try:
        out = corpus.run_tokenizer(task, experiment.program.vocab, tokenizer)
    except ValueError as error:
        raise ConfigError(f"model_args {where}: {error}; {fix}") from None
    if out is None:
        raise ConfigError(f"model_args {where}: the run's task has none; {fix}")
    return out


@functools.partial(jax.jit, static_argnames="program")
def _prefill(params, tokens: jax.Array, fast, *, program: Program):
    """The fast state after ``tokens (B, n)`` from ``fast``."""
    return program.apply(params, tokens, fast)[1]


@register_model("nested")
class NestedLM(LM):
    """The harness model of a trained run (module docstring); ``NestedLM(workdir="runs/x")``,
    or :meth:`from_trained`."""

    def __init__(
        self,
        workdir: str | Path | None = None,
        step: int | None = None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        tokenizer: str | None = None,
        max_gen_toks: int = MAX_GEN_TOKS,
        seed: int = 0,
        device: str | None = None,
        max_batch_size: int | None = None,
        *,
        trained: Trained | None = None,
        **unknown,
    ):
        """The model of ``workdir`` (or ``trained``, a loaded run); see the module docstring.
        ``device`` and ``max_batch_size`` (the harness passes them) are unused: JAX runs on its
        default backend, ``batch_size`` rows at a time."""
        super().__init__()
        del device, max_batch_size
        if unknown:
            raise ConfigError(
                f"model_args {sorted(unknown)}: unknown; the model nested takes {MODEL_ARGS}"
            )
        if trained is None:
            if workdir is None:
                raise ConfigError(
                    "model_args has no workdir; pass model_args workdir=<a run of "
                    "experiments/train.py>"
                )
            experiment = config_lib.build(rundir.load_workdir_config(workdir))
        else:
            experiment = trained.experiment
        task = experiment.task
        if not isinstance(task, TokensTask):
            raise ConfigError(
                f"model_args workdir={workdir}: the run trained on the task {task.name!r}; the "
                "harness evaluates language models of the task 'tokens' (use experiments/eval.py)"
            )
        self.tokenizer = run_tokenizer(experiment, tokenizer)
        self.batch_size = (
            experiment.config.train.eval_batch_size
            if batch_size is None or str(batch_size).startswith("auto")
            else _count("batch_size", batch_size)
        )
        self.context_length = (
            task.seq_len if max_length is None else _count("max_length", max_length)
        )
        self.window = task.split_seq_len("val") if max_length is None else self.context_length
        self.max_gen_toks = _count("max_gen_toks", max_gen_toks)
        self.seed = _count("seed", seed, low=0)
        if trained is None:
            step = None if step is None else _count("step", step, low=0)
            restored = rundir.restore_latest(experiment, rundir.check_run(workdir), step=step)
            trained = Trained(experiment, restored.state, restored.step)
        self.trained, self.task, self.eos = trained, task, self.tokenizer.eos_id
        program, document_eos = trained.program, self.eos if task.documents else None
        self.score = perplexity.make_score_fn(program, document_eos, greedy=True)
        self.rolling_score = perplexity.make_score_fn(program, document_eos)
        self.tokenizer_vocab = self.tokenizer.vocab_size

    @classmethod
    def from_trained(cls, trained: Trained, **model_args) -> NestedLM:
        """The harness model of a :class:`nested.run.loading.Trained` (no workdir read)."""
        return cls(trained=trained, **model_args)

    @property
    def max_length(self) -> int:
        return self.context_length

    # -- text -----------------------------------------------------------------------------

    def tok_encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (EOS and anything after it dropped)."""
        tokens = [int(t) for t in tokens]
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos)]
        if self.tokenizer.hf is not None:
            return self.tokenizer.hf.decode(tokens)
        return bytes(tokens).decode("utf-8", errors="replace")

    # -- the three request types ----------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for i, request in enumerate(requests):
            context, continuation = request.args
            pair = choice.encode_pair(self.tok_encode, self.eos, context, continuation)
            if not 0 < len(pair[1]) <= self.context_length:
                raise ConfigError(
                    f"loglikelihood request {i}: the continuation {continuation[:40]!r} is "
                    f"{len(pair[1])} tokens, not 1 .. {self.context_length}; pass model_args "
                    "max_length=<a larger window>"
                )
            pairs.append(pair)
        arrays = choice.request_arrays(pairs, self.context_length, self.eos)
        lls, greedy = choice.loglikelihoods(
            self.trained, arrays, self.batch_size, self.score, greedy=True
        )
        out = [(float(ll), bool(g)) for ll, g in zip(lls, greedy, strict=True)]
        for request, result in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        align = self.task.align or 1
        windows = [  # (inputs, targets, mask), each (W_i, L), of every text
            perplexity.windows(
                np.asarray(self.tok_encode(request.args[0]), np.int32),
                self.window,
                self.eos,
                align=align,
            )
            for request in requests
        ]
        order = sorted(range(len(windows)), key=lambda i: len(windows[i][0]))  # like lengths
        out = np.zeros(len(windows), np.float64)
        B = self.batch_size
        for start in tqdm(range(0, len(order), B), desc="rolling", disable=None):
            chosen = order[start : start + B]  # text i of row b: its windows in K steps
            shape = (max(len(windows[i][0]) for i in chosen), B, self.window)
            inputs, targets = np.full(shape, self.eos, np.int32), np.full(shape, self.eos, np.int32)
            mask = np.zeros(shape, np.float32)
            for b, i in enumerate(chosen):
                count = len(windows[i][0])
                inputs[:count, b], targets[:count, b], mask[:count, b] = windows[i]
            totals = perplexity.row_nll(
                self.trained, inputs, targets, mask, self.rolling_score, desc="windows"
            )
            out[chosen] = -totals[: len(chosen)]
        for request, ll in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, float(ll))
        return [float(ll) for ll in out]

    def generate_until(self, requests) -> list[str]:
        groups: dict[tuple, list[int]] = {}
        prompts, settings = [], []
        for i, request in enumerate(requests):
            context, kwargs = request.args
            options = self.generation_options(i, kwargs)
            tokens = self.tok_encode(context) or [self.eos]
            keep = max(self.context_length - options["max_new_tokens"], 1)
            prompts.append(tokens[-keep:])
            settings.append(options)
            key = (len(prompts[-1]), *sorted((k, str(v)) for k, v in options.items()))
            groups.setdefault(key, []).append(i)
        out = [""] * len(requests)
        for members in tqdm(groups.values(), desc="generate", disable=None):
            for start in range(0, len(members), self.batch_size):
                chosen = members[start : start + self.batch_size]
                texts = self._generate([prompts[i] for i in chosen], settings[chosen[0]])
                for i, text in zip(chosen, texts, strict=True):
                    out[i] = text
        for request, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    # -- generation -----------------------------------------------------------------------

    def generation_options(self, index: int, kwargs: dict) -> dict[str, Any]:
        """The sampler's options from the ``gen_kwargs`` of request ``index`` (module
        docstring): ``until`` (a list), ``max_new_tokens``, ``temperature`` (0: greedy) and
        ``top_k``."""
        where = f"generate_until request {index}:"
        unknown = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ConfigError(
                f"{where} gen_kwargs {unknown} are not supported; use {list(GENERATION_KEYS)}"
            )
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(u, str) for u in until):
            raise ConfigError(f"{where} until={until!r}: use a string or a list of strings")
        max_new = _count("max_gen_toks", kwargs.get("max_gen_toks", self.max_gen_toks), 1, where)
        temperature = kwargs.get("temperature", 1.0 if kwargs.get("do_sample") else 0.0)
        if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
            raise ConfigError(f"{where} temperature={temperature!r}: use a number >= 0")
        if not kwargs.get("do_sample") or temperature <= 0:
            temperature = 0.0
        top_k = kwargs.get("top_k")
        top_k = None if top_k in (None, 0) or not temperature else _count("top_k", top_k, 1, where)
        return {
            "until": until,
            "max_new_tokens": max_new,
            "temperature": float(temperature),
            "top_k": top_k,
        }

    def continuations(self, prompts: list[list[int]], options: dict[str, Any]) -> list[list[int]]:
        """The generated ids of ``prompts`` (token ids, all of one length) with ``options`` (of
        :meth:`generation_options`), each up to and including its stop token."""
        program, params = self.trained.program, self.trained.state.params
        rows = 1 << (len(prompts) - 1).bit_length()  # padded to a power of two
        tokens = np.array(prompts + [prompts[-1]] * (rows - len(prompts)), np.int32)
        whole = bool(sampling.whole_stream_layers(program.model(params)))
        fast = None if whole else program.start_fast(params, rows)
        period = sampling.stream_period(program, params)
        head = len(prompts[0]) - ((len(prompts[0]) - 1) % period + 1)  # a multiple of P
        if whole:
            head = 0  # no cut continues its stream: the sampler reads the prompt whole
        done = 0
        while done < head:  # pieces of 2^j P tokens, largest first
            size = period * (1 << (((head - done) // period).bit_length() - 1))
            fast = _prefill(params, tokens[:, done : done + size], fast, program=program)
            done += size
        stop = {self.eos}
        for text in options["until"]:
            ids = self.tok_encode(text)
            if len(ids) == 1:
                stop.add(ids[0])
        sample = sampling.generate(
            program,
            params,
            tokens[:, head:],
            max_new_tokens=options["max_new_tokens"],
            temperature=options["temperature"],
            top_k=options["top_k"],
            stop=sorted(stop),
            rng=self.seed,
            fast=fast,
            vocab=self.tokenizer_vocab,
        )
        generated = np.asarray(sample.tokens)
        return [generated[row, : sample.lengths[row]].tolist() for row in range(len(prompts))]

    def _generate(self, prompts: list[list[int]], options: dict[str, Any]) -> list[str]:
        """The texts of :meth:`continuations`, each cut before its first ``until`` string."""
        texts = []
        for tokens in self.continuations(prompts, options):
            text = self.tok_decode(tokens)
            for term in options["until"]:
                if term:
                    text = text.split(term)[0]
            texts.append(text)
        return texts


def main() -> None:
    """The harness's ``lm_eval`` command line (every argument as there) with the model
    ``nested`` registered; a user mistake ends in one line, ``error: ...``."""
    from lm_eval.__main__ import cli_evaluate

    with cli.user_errors():
        cli_evaluate()


if __name__ == "__main__":
    main()
