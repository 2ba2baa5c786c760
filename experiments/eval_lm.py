"""Evaluate a language model: ``python experiments/eval_lm.py --workdir DIR``.

Restores the latest checkpoint of a run trained on the task ``tokens`` and writes
``DIR/eval_lm.json`` (or ``--out``), a printed table and TensorBoard scalars (``DIR/eval_lm``):
perplexity and bits per byte of the whole val split of the run's corpus (``--data=FOLDER``: of
another folder prepared with the same tokenizer), mean nll by position in windows of
``--max_len`` (default 4 x the trained length; a multiple of it), and zero-shot multiple choice
by log-likelihood (lm-evaluation-harness ``loglikelihood``: acc, acc_norm, acc_bytes) on local
JSONL files, ``--tasks=name=path.jsonl,...``, one ``{"context": str, "choices": [str, ...],
"answer": int}`` per line. RULER's single-needle tasks,
``--needle=niah_single_1,niah_single_2``: accuracy of greedy answers by context length
(``--needle_lengths``, default 1024,2048,4096,8192 tokens) over ``--needle_samples`` needles
per length, swept through the context (``nested.run.needle``).
``--batch_size`` rows per call (default ``train.eval_batch_size``).
Bad input ends in one line, ``error: ...``, before anything is compiled. Everything is in
``nested.run.lm_eval``.

Example: ``python experiments/eval_lm.py --workdir runs/lm --tasks=copa=data/copa.jsonl``.
"""

from absl import flags

from nested.run import choice, cli, lm_eval, needle

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run to evaluate.")
_DATA = flags.DEFINE_string("data", None, "Prepared folder to score; default: the run's.")
_TASKS = flags.DEFINE_list("tasks", [], "Multiple-choice tasks: name=path.jsonl,...")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "Window of nll by position; default 4 x T.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Rows per call; default the run's.")
_OUT = flags.DEFINE_string("out", None, "Results file; default DIR/eval_lm.json.")
_NEEDLE = flags.DEFINE_list("needle", [], f"RULER needle tasks: some of {list(needle.TASKS)}.")
_NEEDLE_LENGTHS = flags.DEFINE_list(
    "needle_lengths", [str(n) for n in needle.LENGTHS], "Needle context lengths, in tokens."
)
_NEEDLE_SAMPLES = flags.DEFINE_integer("needle_samples", 50, "Needles per task and length.")
_NEEDLE_NEW_TOKENS = flags.DEFINE_integer(
    "needle_new_tokens", needle.NEW_TOKENS, "Tokens generated per needle answer."
)
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    with cli.user_errors():
        lm_eval.evaluate_lm(
            _WORKDIR.value,
            data=_DATA.value,
            tasks=choice.parse_tasks(_TASKS.value),
            max_len=_MAX_LEN.value,
            batch_size=_BATCH_SIZE.value,
            out=_OUT.value,
            needle_tasks=_NEEDLE.value,
            needle_lengths=needle.parse_lengths(_NEEDLE_LENGTHS.value),
            needle_samples=_NEEDLE_SAMPLES.value,
            needle_new_tokens=_NEEDLE_NEW_TOKENS.value,
        )


if __name__ == "__main__":
    cli.run(main)
