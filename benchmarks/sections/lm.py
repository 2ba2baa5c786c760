"""The "Language modelling on real text" section: ``configs/lm.py``'s ``small`` models trained
on the same tokens of the Python documentation's sources, then scored by
``experiments/eval_lm.py`` (its ``eval_lm.json``); and the plot of their training and held-out
losses (:data:`CURVES`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from nested.run import metrics
from sections import plots, text
from sections.rows import ROOT, Row, Runs, Section

# The Python documentation's reStructuredText sources (Debian's python3-doc: `apt-get install
# python3-doc`), a BPE of 8192 trained on them, the `small` size of configs/lm.py (about 7.4M
# parameters, equal within 10%) trained on the same tokens (STEPS x 16 x 256).
SCRIPT = "experiments/eval_lm.py"
RESULT = "eval_lm.json"
MODELS = ("transformer", "deltanet", "gated_deltanet", "titans", "hope")
CORPUS = "data/python_docs"
SOURCE = "/usr/share/doc/python3/html/_sources"
PREPARE = (
    "python",
    "experiments/prepare.py",
    f"--input={SOURCE}",
    f"--out={CORPUS}",
    "--tokenizer=bpe",
    "--vocab_size=8192",
    "--val_fraction=0.05",
)
DOCUMENTS = ("task.documents", False)  # documents packed without restarts, as flame trains
STEPS = 120  # Hope, the slowest, takes about 14 s a step here: 28 minutes
CURVES = "benchmarks/figures/lm_real_text.png"  # committed beside RESULTS.md
# The "RULER single needle" section's measurement, made by the same eval_lm run: 32 needles per
# task and length (2 batches of 16) keep a model's needles within minutes on the CPU.
NEEDLE = ("--needle=niah_single_1,niah_single_2", "--needle_samples=32")


def rows() -> list[Row]:
    overrides = (("task.path", CORPUS), ("train.steps", STEPS), DOCUMENTS)
    return [
        Row(f"lm/{m}", f"configs/lm.py:{m}-small", overrides, after=(SCRIPT, *NEEDLE))
        for m in MODELS
    ]


def prepare_corpus() -> None:
    """Prepare the real-text corpus the ``lm/`` rows train on, unless it is there."""
    if (ROOT / CORPUS / "index.json").exists():
        return
    if not Path(SOURCE).is_dir():
        sys.exit(f"error: {SOURCE} is missing: apt-get install python3-doc")
    subprocess.run([sys.executable, *PREPARE[1:]], cwd=ROOT, check=True)


def _logged_parameters(workdir: Path) -> int | None:
    """The slow-parameter count the training run logged (``model: N slow parameters``)."""
    path = workdir / "train.stderr.txt"
    found = re.search(r"model: (\d+) slow parameters", path.read_text()) if path.exists() else None
    return None if found is None else int(found.group(1))


def _buckets(position: dict) -> list[tuple[int, int]]:
    """Position ranges of the table: the trained length in halves, then each further length."""
    t, end = position["trained_len"], position["max_len"]
    return [(0, t // 2), (t // 2, t), *((lo, lo + t) for lo in range(t, end, t))]


def _bucket_ppl(position: dict, lo: int, hi: int) -> float:
    return float(np.exp(np.mean(position["nll"][lo:hi])))


def _tokens_per_step(workdir: Path) -> int:
    """Training tokens a step of the run in ``workdir`` (its ``config.json``)."""
    config = json.loads((workdir / "config.json").read_text())
    return config["train"]["batch_size"] * config["task"]["seq_len"]


def table(runs: Runs, entries: dict) -> list[str]:
    evals = {row_id: runs.json(row_id, RESULT) for row_id in entries}
    shown = next((e for e in evals.values() if e), None)
    buckets = [] if shown is None else _buckets(shown["position"])
    head = ["model", "params", "tokens", "wall", "val loss", "perplexity", "bits/byte"]
    head += [f"ppl {lo}-{hi - 1}" for lo, hi in buckets] + ["command"]
    lines = text.head(head)
    for row_id, (record, _) in entries.items():
        result = evals[row_id]
        failed = text.failed(record, result, RESULT)
        model = row_id.split("/", 1)[1]
        if failed:
            lines.append(text.failed_row(model, failed, len(head)))
            continue
        params = _logged_parameters(runs.workdir / row_id)
        val, position = result["val"], result["position"]
        cells = [
            model,
            "—" if params is None else f"{params / 1e6:.2f}M",
            f"{STEPS * _tokens_per_step(runs.workdir / row_id) / 1e6:.2f}M",
            text.wall(record),
            f"{val['nll']:.3f}",
            f"{val['perplexity']:.1f}",
            f"{val['bits_per_byte']:.3f}",
            *(f"{_bucket_ppl(position, lo, hi):.1f}" for lo, hi in buckets),
            text.commands(record),
        ]
        lines.append(text.row(cells))
    return lines


def plot(runs: Runs, entries: dict) -> None:
    """Plot every ``lm/`` row's training loss (points: held-out loss) against tokens into
    :data:`CURVES` under the page's directory."""
    fig, ax = plots.subplots(figsize=(7, 4))
    for row_id, (_, records) in entries.items():
        train_records = [r for r in records if r["split"] == metrics.TRAIN]
        held = [r for r in records if r["split"] == "val" and "loss" in r]
        tokens = _tokens_per_step(runs.workdir / row_id)
        (line,) = ax.plot(
            [r["step"] * tokens / 1e6 for r in train_records],
            [r["loss"] for r in train_records],
            label=row_id.split("/", 1)[1],
        )
        ax.plot(
            [r["step"] * tokens / 1e6 for r in held],
            [r["loss"] for r in held],
            "o",
            color=line.get_color(),
        )
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Python documentation, BPE 8192: train (lines), held-out (points)")
    ax.legend()
    ax.grid(alpha=0.3)
    plots.save(fig, runs.page, CURVES)


def render(runs: Runs) -> str:
    entries = runs.rows("lm/")
    parts = text.parts("lm")
    figure = ""
    if entries:
        plot(runs, entries)
        figure = text.fill(parts["figure"], path=CURVES)
    return text.fill(
        parts["section"],
        prepare=" ".join(PREPARE),
        steps=STEPS,
        documents=f"{DOCUMENTS[0]}={DOCUMENTS[1]}",
        table=table(runs, entries),
        figure=figure,
    )


SECTIONS = (Section("lm", text.title("lm"), render),)
