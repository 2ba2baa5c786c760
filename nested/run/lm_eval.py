"""Language-model evaluation of a trained run: ``evaluate_lm(workdir, ...)`` (``experiments/
eval_lm.py``): perplexity and bits per byte, perplexity by position past the trained length,
zero-shot multiple choice, RULER's single-needle tasks by context length.

The run is a workdir of ``experiments/train.py`` trained on the task ``tokens`` (a corpus of
``experiments/prepare.py``), scored on the ``val`` split of a prepared folder (the run's
``task.path``, or ``data``: a folder of the same tokenizer) by its own ``Program.apply``. The
perplexity of that split, whole and by position: :mod:`nested.run.perplexity`; the
multiple-choice tasks: :mod:`nested.run.choice`; the needle tasks (``needle_tasks``, greedy
generation from prompts of the run's tokenizer): :mod:`nested.run.needle`.

**Output.** ``eval_lm.json`` in the workdir (or ``out``), a printed table, and the scalars at
the checkpoint's step through :class:`nested.run.metrics.MetricWriter` in ``<workdir>/eval_lm``
(``metrics.jsonl`` and TensorBoard ``<section>/<metric>``; sections ``val``, ``position`` and one
per task), apart from the run's own metrics.

**Bad input** raises :class:`nested.run.config.ConfigError` (or
:class:`nested.run.checkpoint.CheckpointError`) with one line naming the problem and the fix,
before anything is compiled: a workdir without a run or a checkpoint, a run not trained on the
task ``tokens``, a data folder that is not a prepared corpus or whose tokenizer is not the
run's, a ``max_len`` that is not a multiple of T, a task file that is missing, not JSONL, lacks
a field, has an answer out of range, a continuation longer than T tokens, or no example; a
needle task that is unknown, a needle length too short for its prompt or longer than the val
split can fill, or a corpus without its tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nested import files
from nested.data import TokensTask, corpus
from nested.run import checkpoint, metrics, needle, rundir
from nested.run import config as config_lib
from nested.run.choice import choice_metrics, loglikelihoods, make_requests, read_task
from nested.run.config import ConfigError
from nested.run.loading import Trained
from nested.run.perplexity import (
    POSITION,
    SPLIT,
    by_position,
    make_score_fn,
    perplexity,
    val_stream,
)

RESULTS_FILE = "eval_lm.json"
METRICS_DIR = "eval_lm"  # <workdir>/eval_lm: the MetricWriter's metrics.jsonl and TensorBoard


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
    needle_tasks: Sequence[str] = (),
    needle_lengths: Sequence[int] = needle.LENGTHS,
    needle_samples: int = 50,
    needle_new_tokens: int = needle.NEW_TOKENS,
) -> dict[str, Any]:
    """Evaluate the latest checkpoint of ``workdir`` (module docstring) and return the results
    written to ``out`` (default ``<workdir>/eval_lm.json``).

    ``data``: a prepared folder to score instead of the run's ``task.path``; ``tasks``: ``{name:
    task file}`` of multiple-choice tasks; ``max_len``: the window of perplexity by position
    (default 4 x the trained ``seq_len``); ``batch_size``: rows per call (default
    ``train.eval_batch_size``); ``needle_tasks``: RULER tasks (:data:`nested.run.needle.TASKS`) at
    context lengths ``needle_lengths``, ``needle_samples`` samples each, ``needle_new_tokens``
    generated. Everything is checked before anything is compiled.
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
    requests, needles = {}, []
    if tasks or needle_tasks:
        try:
            tokenizer = corpus.prepared_tokenizer(task.path, task.index)
        except corpus.PrepareError as error:
            raise ConfigError(str(error)) from None
    if needle_tasks:
        for name, value in (
            ("needle_samples", needle_samples),
            ("needle_new_tokens", needle_new_tokens),
            *(("needle_lengths", n) for n in needle_lengths),
        ):
            _positive(name, value)
        needles = needle.make_requests(
            tokenizer,
            needle_tasks,
            needle_lengths,
            needle_samples,
            documents=task.documents,
            val_tokens=val_stream(task),
            where=str(task.path),
            new_tokens=needle_new_tokens,
        )
    if tasks:
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
        "needle": {},
    }
    for name, (examples, made) in requests.items():
        lls = loglikelihoods(trained, made, batch_size, score)
        result["tasks"][name] = {"path": str(tasks[name]), **choice_metrics(examples, lls)}
    if needles:
        result["needle"] = needle.needle_metrics(
            trained, tokenizer, needles, batch_size, needle_new_tokens
        )

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
    for name, values in result["needle"].items():
        out[name] = {f"acc_{n}": r["accuracy"] for n, r in values["lengths"].items()}
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
    for name, values in result["needle"].items():
        lines.append(f"  {name} (accuracy, Wilson 95% interval, by context length):")
        for n, r in values["lengths"].items():
            interval = f"[{r['low']:.3f}, {r['high']:.3f}]"
            lines.append(
                f"    {n:>6}  {r['correct']:>4}/{r['samples']:<4} {r['accuracy']:6.3f}  {interval}"
            )
    return "\n".join(lines)
