"""python benchmarks/results.py --out RESULTS.md

The results table: every row is one training run of a shipped config, launched exactly as a
user launches it (``python experiments/train.py --config ... --workdir ...``, a subprocess),
its wall time measured around the subprocess and its final held-out metrics read from the
workdir's ``metrics.jsonl``. Rows:

* MQAR test accuracy per test setting and their mean, for every rule of
  ``nested.recipes.RULES`` at two model widths (``--widths``), and the Hope variant;
* bits per character on held-out files for the character-LM configs;
* needle-in-a-haystack accuracy by context length;
* the continual stream: accuracy from the context and from memory, and forgetting;
* functional plasticity: rows trained, then measured by ``experiments/plasticity.py`` (its
  ``plasticity.json``): the continual-learning matrix, forgetting and regret utility of three
  models of equal slow-parameter count on agents of the continual stream, and the alignment
  of TTT-style levels at initialisation and after training.

A row that fails shows its error; nothing is dropped. A finished row is not rerun unless
``--rerun`` (its workdir keeps ``row.json``: command, wall time, exit status), so an
interrupted table resumes. ``--only REGEX`` runs the rows whose id matches (``mqar/.*_d64``);
the table always holds every row that has a result. Overrides a row needs to fit a CPU budget
are part of its command and listed next to it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import report
from absl import app, flags

from nested.levels import recipes
from nested.plasticity import transfer
from nested.run import config as nc
from nested.run import metrics

ROOT = Path(__file__).resolve().parents[1]
ROW_FILE = "row.json"

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "RESULTS.md", "Markdown file written (relative to the repository).")
flags.DEFINE_string("workdir", "runs/results", "Root of the rows' workdirs.")
flags.DEFINE_string("only", None, "Run only the rows whose id matches this regex.")
flags.DEFINE_list("widths", ["64", "128"], "MQAR model widths (model.dim).")
flags.DEFINE_boolean("rerun", False, "Rerun rows that already have a result.")
flags.DEFINE_boolean("dry_run", False, "Print the commands, run nothing.")
flags.DEFINE_integer("timeout", 3600, "Seconds before a row is stopped (and reported failed).")
flags.DEFINE_list(
    "sections",
    None,
    "Rewrite only these sections of --out (plasticity, companion, lm, frequencies, "
    "frequencies_disjoint, frequencies_review, frequencies_load), keeping the rest of the page.",
)
SECTIONS = {
    "plasticity": "Functional plasticity",
    "companion": "Agent companion",
    "lm": "Language modelling on real text",
    "frequencies": "Multi-frequency memory and forgetting",
    "frequencies_disjoint": "Multi-frequency memory on disjoint keys",
    "frequencies_review": "Multi-frequency memory with review queries",
    "frequencies_load": "Multi-frequency memory at a load one head holds",
}


class Row(NamedTuple):
    """One run: ``id`` (also its workdir under ``--workdir``), the config spec, the overrides
    (``key -> value``, passed as ``--config.key=value``), and why they are there;
    ``after``: a script and its flags run on the trained workdir after training
    (``experiments/plasticity.py``, ``experiments/companion_study.py``; None: none)."""

    id: str
    config: str
    overrides: tuple[tuple[str, object], ...] = ()
    note: str = ""
    after: tuple[str, ...] | None = None


# Rows whose defaults do not fit a few minutes of two shared CPU cores, and why.
MQAR_OVERRIDES: dict[str, tuple[tuple[tuple[str, object], ...], str]] = {
    # Muon orthogonalises the momentum at every token (Newton-Schulz, O(d^3) per token): the
    # default two-layer memory takes ~10 s a step at width 64 here; a linear memory (on the
    # polynomial features) in chunks of 8, on half batches, fits.
    "atlas": (
        (
            ("levels.memory.depth", 1),
            ("levels.memory.every", 8),
            ("train.batch_size", 16),
            ("train.steps", 400),
        ),
        "linear memory, chunks of 8, batch 16, 400 steps",
    ),
    # The per-token scan of the deep memory: ~0.8 s a step at width 64; chunks of 4 (8x
    # fewer sequential steps), with the per-token step range these rows were measured with
    # (the recipe's default is now 0.1 / every).
    "titans": (
        (("levels.memory.every", 4), ("levels.memory.lr_scale", 0.1)),
        "chunks of 4, step range (0, 0.1)",
    ),
}
CHAR_LM_STEPS = 200  # the configs train 3000 steps: hours here for the neural memories
# Hope's two-layer model takes ~2 s a step here (each CMS window's gradient runs through the
# second layer's Titans memory, and the outer gradient differentiates that gradient); it also
# runs with one layer, next to DeltaNet in the same setting. Titans in chunks of 16 gets the
# step range (0, 0.1/16) by default (the config notes why).
ONE_LAYER = (("model.layers", 1),)
CHAR_LM_ROWS = (
    ("delta", "delta", (), ""),
    ("ttt_linear", "ttt_linear", (), ""),
    ("ttt_mlp", "ttt_mlp", (), ""),
    ("titans", "titans", (), ""),
    ("titans_mag", "titans_mag", (), ""),
    ("titans_mac", "titans_mac", (), "segments of 32, Titans in chunks of 16"),
    ("hope", "hope", (), ""),
    ("delta_1layer_200", "delta", ONE_LAYER, "1 layer"),
    ("hope_1layer_200", "hope", ONE_LAYER, "1 layer"),
    (
        "hope_first_order",
        "hope",
        tuple((f"levels.cms{i}.first_order", True) for i in (1, 2, 3)),
        "CMS levels first order",
    ),
    (
        "titans_every16",
        "titans",
        (("levels.memory.every", 16),),
        "Titans in chunks of 16, step range (0, 0.1/16)",
    ),
)


def rows(widths: Sequence[int]) -> list[Row]:
    out = []
    for rule in sorted(recipes.RULES):
        overrides, note = MQAR_OVERRIDES.get(rule, ((), ""))
        for dim in widths:
            out.append(
                Row(
                    f"mqar/{rule}_d{dim}",
                    f"configs/mqar.py:{rule}",
                    (("model.dim", dim), *overrides),
                    note,
                )
            )
    for dim in widths:
        out.append(Row(f"mqar/hope_d{dim}", "configs/mqar.py:hope", (("model.dim", dim),)))
    for row_id, variant, overrides, note in CHAR_LM_ROWS:
        if "train.steps" not in dict(overrides):
            overrides = (("train.steps", CHAR_LM_STEPS), *overrides)
        out.append(Row(f"char_lm/{row_id}", f"configs/char_lm.py:{variant}", overrides, note))
    out.append(Row("niah/delta", "configs/niah.py:delta"))
    out.append(Row("continual/delta", "configs/continual.py:delta"))
    for variant in PLASTICITY_MODELS:
        config = f"configs/continual.py:{variant}"
        out.append(Row(f"plasticity/{variant}", config, after=(PLASTICITY, *PLASTICITY_FLAGS)))
    for rule in ALIGNMENT_RULES:
        config = f"configs/mqar.py:{rule}"
        out.append(Row(f"plasticity/{rule}", config, after=(PLASTICITY, "--protocols=alignment")))
    out.append(Row("companion/delta", "configs/companion.py", after=(COMPANION_STUDY,)))
    for stream, (models, overrides, seeds) in FREQUENCY_STREAMS.items():
        for seed in seeds:
            for model in models:
                variant, fixed = _variant(model)
                out.append(
                    Row(
                        f"{stream}/{model}/seed{seed}",
                        f"configs/continual.py:{variant}",
                        (("seed", seed), *overrides, *fixed),
                        after=(PLASTICITY, *FREQUENCY_FLAGS),
                    )
                )
    for model in LM_MODELS:
        overrides = (("task.path", LM_CORPUS), ("train.steps", LM_STEPS), LM_DOCUMENTS)
        out.append(Row(f"lm/{model}", f"configs/lm.py:{model}-small", overrides, after=(EVAL_LM,)))
    return out


# The functional-plasticity comparison (configs/continual.py: equal slow-parameter count) and
# its deployment: phases of 4 sessions of 2 sequences per task, regret sessions of 2.
PLASTICITY, COMPANION_STUDY = "experiments/plasticity.py", "experiments/companion_study.py"
PLASTICITY_MODELS = ("one_level", "two_level", "hope")
PLASTICITY_FLAGS = ("--sessions=4", "--session_length=2", "--cycles=3")
ALIGNMENT_RULES = ("ttt_linear", "ttt_mlp")  # TTT-style levels, at initialisation and trained
# Multi-frequency memory and forgetting: one level against two (a fast and a slow head of one
# layer, the slow one learning the same stream or consolidating the fast one) at equal slow
# parameters and carried bytes, and Hope with its memory carried; seeds of training.
FREQUENCY_MODELS = (
    "one_level",
    "one_level_wide",
    *(f"{kind}_1_{period}" for kind in ("periods", "consolidate") for period in (8, 32, 128)),
    "one_level_wider",
    "three_level",
    "hope_carried",
)
FREQUENCY_SEEDS = (0, 1, 2)
FREQUENCY_FLAGS = ("--sessions=4", "--session_length=2", "--protocols=transfer")
# The same comparison on a stream where retention can pay: every task its own 32 keys (tokens
# 1..128 of a vocabulary of 288), so no later task changes an earlier task's answers.
DISJOINT_MODELS = (
    "one_level",
    "one_level_wide",
    "periods_1_32",
    "consolidate_1_32",
    "consolidate_1_128",
    "one_level_wider",
    "three_level",
)
DISJOINT = (("task.disjoint_keys", True), ("task.remap_fraction", 1.0), ("task.vocab_size", 288))
# And with half the training queries on the earlier tasks' keys of the agent (review), so
# the training loss rewards keeping them; with the slow head's step size fixed (`_lr<value>`:
# `levels.slow.lr`) instead of the gate the outer loop learns.
REVIEW = (*DISJOINT, ("task.review_queries", 4))
FIXED_SLOW_LR = tuple(f"consolidate_1_32_lr{lr}" for lr in (0.03, 0.1, 0.3, 1.0))
# And at a load one head can hold: 8 keys a task (32 pairs over the four tasks, what a 32 x 32
# head stores without interference), 4 of them presented a sequence: is the forgetting a matter
# of capacity, or do the learned gates discard what would fit?
LOAD_MODELS = ("one_level", "one_level_wide", "periods_1_32", "consolidate_1_32")
LOAD = (*DISJOINT, ("task.num_keys", 8), ("task.num_pairs", 4))
FREQUENCY_STREAMS = {  # stream: (models, overrides, training seeds)
    "frequencies": ((*FREQUENCY_MODELS, *FIXED_SLOW_LR), (), FREQUENCY_SEEDS),
    "frequencies_disjoint": (DISJOINT_MODELS, DISJOINT, FREQUENCY_SEEDS),
    "frequencies_review": ((*DISJOINT_MODELS, *FIXED_SLOW_LR), REVIEW, FREQUENCY_SEEDS[:1]),
    "frequencies_load": (LOAD_MODELS, LOAD, FREQUENCY_SEEDS),
}


def _variant(model: str) -> tuple[str, tuple]:
    """A model name's config variant and overrides: ``X_lr<value>`` is ``X`` with its slow
    head's step size fixed at the value."""
    variant, _, lr = model.partition("_lr")
    return variant, ((("levels.slow.lr", float(lr)),) if lr else ())


# Language modelling on real text: the Python documentation's reStructuredText sources
# (Debian's python3-doc: `apt-get install python3-doc`), a BPE of 8192 trained on them, the
# `small` size of configs/lm.py (about 7.4M parameters, equal within 10%) trained on the
# same tokens (LM_STEPS x 16 x 256), then experiments/eval_lm.py.
EVAL_LM = "experiments/eval_lm.py"
LM_MODELS = ("transformer", "deltanet", "gated_deltanet", "titans", "hope")
LM_CORPUS = "data/python_docs"
LM_SOURCE = "/usr/share/doc/python3/html/_sources"
LM_PREPARE = (
    "python",
    "experiments/prepare.py",
    f"--input={LM_SOURCE}",
    f"--out={LM_CORPUS}",
    "--tokenizer=bpe",
    "--vocab_size=8192",
    "--val_fraction=0.05",
)
# Documents packed without restarts, as flame trains by default.
LM_DOCUMENTS = ("task.documents", False)
LM_STEPS = 120  # Hope, the slowest, takes about 14 s a step here: 28 minutes


def prepare_lm_corpus() -> None:
    """Prepare the real-text corpus the ``lm/`` rows train on, unless it is there."""
    if (ROOT / LM_CORPUS / "index.json").exists():
        return
    if not Path(LM_SOURCE).is_dir():
        sys.exit(f"error: {LM_SOURCE} is missing: apt-get install python3-doc")
    subprocess.run([sys.executable, *LM_PREPARE[1:]], cwd=ROOT, check=True)


def command(row: Row, workdir: Path) -> list[str]:
    flags_ = [f"--config.{k}={v}" for k, v in row.overrides]
    return [
        "python",
        "experiments/train.py",
        f"--config={row.config}",
        f"--workdir={workdir}",
        *flags_,
    ]


def after_command(row: Row, workdir: Path) -> list[str]:
    script, *flags_ = row.after
    return ["python", script, f"--workdir={workdir}", *flags_]


def _run(argv: list[str], workdir: Path, name: str, timeout: int) -> dict:
    """Run ``argv`` (``python ...``) from the repository, its output in ``workdir/<name>.*``:
    ``{"command", "wall_s", "status", "error"}``."""
    start = time.perf_counter()
    out_path, err_path = workdir / f"{name}.stdout.txt", workdir / f"{name}.stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        try:
            status = subprocess.run(
                [sys.executable, *argv[1:]], cwd=ROOT, stdout=out, stderr=err, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    wall = time.perf_counter() - start
    error = None
    if status != 0:
        lines = err_path.read_text().strip().splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        error = (errors or lines or [f"exit status {status}"])[-1][:300]
        if status == "timeout":
            error = f"stopped after {timeout} s"
    return {"command": " ".join(argv), "wall_s": wall, "status": status, "error": error}


def run_row(row: Row, workdir: Path, timeout: int) -> dict:
    """Train ``row`` in a fresh ``workdir`` (relative to the repository, as in the command),
    then run its ``after`` script if it has one; writes ``row.json``: command, wall time,
    exit status (and ``after``: the same of that script)."""
    relative = workdir
    workdir = ROOT / workdir
    if workdir.exists():  # a fresh run: the table's numbers come from one uninterrupted run
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    record = _run(command(row, relative), workdir, "train", timeout)
    if row.after is not None and record["status"] == 0:
        record["after"] = _run(after_command(row, relative), workdir, "after", timeout)
    (workdir / ROW_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


# -- the tables ---------------------------------------------------------------------------------


def _load(workdir: Path) -> tuple[dict | None, list[dict]]:
    path = workdir / ROW_FILE
    if not path.exists():
        return None, []
    return json.loads(path.read_text()), metrics.read(workdir)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def _cmd(record: dict) -> str:
    return f"`{record['command']}`"


def _outcome(record: dict, final: dict) -> str | None:
    """None if the row has results to show, else the cell text explaining why not."""
    if record["status"] == 0 and final:
        return None
    return f"**failed**: {record['error'] or 'no evaluation'}"


def _wall(record: dict) -> str:
    return f"{record['wall_s']:.0f} s"


def mqar_table(results: dict[str, tuple[dict, list]]) -> list[str]:
    entries = {k: v for k, v in results.items() if k.startswith("mqar/")}
    splits = []
    for _, records in entries.values():
        for split in metrics.final_eval(records):
            if split not in splits:
                splits.append(split)
    head = ["rule", "dim", *splits, "mean", "steps", "wall", "command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row_id, (record, records) in entries.items():
        rule, dim = row_id.removeprefix("mqar/").rsplit("_d", 1)
        final = metrics.final_eval(records)
        failed = _outcome(record, final)
        cells = [_pct(final[s]["accuracy"]) if s in final else "—" for s in splits]
        mean = metrics.summary(records).get("mean_accuracy") if final else None
        steps = max((r["step"] for r in final.values()), default=0)
        if failed:
            cells = [failed] + [""] * (len(splits) - 1)
        lines.append(
            "| "
            + " | ".join([rule, dim, *cells, _pct(mean), str(steps), _wall(record), _cmd(record)])
            + " |"
        )
    return lines


def char_lm_table(results, row_notes: dict[str, str]) -> list[str]:
    head = ["variant", "val bpc", "steps", "note", "wall", "command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row_id, (record, records) in results.items():
        if not row_id.startswith("char_lm/"):
            continue
        final = metrics.final_eval(records)
        failed = _outcome(record, final)
        bpc = failed or f"{final['val']['bpc']:.3f}"
        steps = max((r["step"] for r in final.values()), default=0)
        note = row_notes.get(row_id, "")
        lines.append(
            f"| {row_id.removeprefix('char_lm/')} | {bpc} | {steps} | {note} | {_wall(record)} | "
            f"{_cmd(record)} |"
        )
    return lines


def niah_table(results) -> list[str]:
    lines = []
    for row_id, (record, records) in results.items():
        if not row_id.startswith("niah/"):
            continue
        final = metrics.final_eval(records)
        splits = list(final)
        if not lines:
            head = ["rule", *(f"accuracy {s}" for s in splits), "steps", "wall", "command"]
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        failed = _outcome(record, final)
        cells = [failed] if failed else [_pct(final[s]["accuracy"]) for s in splits]
        steps = max((r["step"] for r in final.values()), default=0)
        rule = row_id.removeprefix("niah/")
        lines.append(
            "| " + " | ".join([rule, *cells, str(steps), _wall(record), _cmd(record)]) + " |"
        )
    return lines


def forgetting(records: list[dict], switch_every: int) -> tuple[dict[str, float], float | None]:
    """Per task k (but the last trained): its from-memory accuracy at the end of its phase
    (step ``(k + 1) * switch_every``) minus the final one; and their mean."""
    final = metrics.final_eval(records)
    last = max(r["step"] for r in final.values())
    drops = {}
    for split, record in final.items():
        end = (int(split.removeprefix("task")) + 1) * switch_every
        at_end = [r for r in records if r["split"] == split and r["step"] == end]
        if end < last and at_end and "memory_accuracy" in record:
            drops[split] = at_end[0]["memory_accuracy"] - record["memory_accuracy"]
    mean = sum(drops.values()) / len(drops) if drops else None
    return drops, mean


def continual_table(results, workdir: Path) -> list[str]:
    head = [
        "rule",
        "task",
        "accuracy",
        "in-context",
        "from memory",
        "from memory at the end of its phase",
        "forgetting",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    commands = []
    for row_id, (record, records) in results.items():
        if not row_id.startswith("continual/"):
            continue
        rule = row_id.removeprefix("continual/")
        final = metrics.final_eval(records)
        failed = _outcome(record, final)
        commands.append(f"* {rule} ({_wall(record)}): {_cmd(record)}")
        if failed:
            lines.append(f"| {rule} | {failed} |" + " |" * (len(head) - 2))
            continue
        config = json.loads((workdir / row_id / "config.json").read_text())
        switch = config["task"]["switch_every"]
        drops, mean = forgetting(records, switch)
        for split, r in final.items():
            end = (int(split.removeprefix("task")) + 1) * switch
            at_end = [x for x in records if x["split"] == split and x["step"] == end]
            lines.append(
                f"| {rule} | {split} (steps {end - switch}-{end}) | {_pct(r['accuracy'])} | "
                f"{_pct(r.get('in_context_accuracy'))} | {_pct(r.get('memory_accuracy'))} | "
                f"{_pct(at_end[0].get('memory_accuracy') if at_end else None)} | "
                f"{_pct(drops.get(split))} |"
            )
        lines.append(f"| {rule} | mean forgetting | | | | | {_pct(mean)} |")
    return lines + [""] + commands


def _plasticity(results, workdir: Path) -> dict[str, tuple[dict, dict | None]]:
    """``{row id: (row record, plasticity.json or None)}`` of the plasticity rows."""
    out = {}
    for row_id, (record, _) in results.items():
        if row_id.startswith("plasticity/"):
            path = workdir / row_id / "plasticity.json"
            out[row_id] = (record, json.loads(path.read_text()) if path.exists() else None)
    return out


def _failed(record: dict, result: dict | None) -> str | None:
    if result is not None:
        return None
    measured = record.get("after") or {}
    return f"**failed**: {measured.get('error') or record['error'] or 'no plasticity.json'}"


def _ci(figures: dict, mask) -> str:
    """Mean utility over the ``mask``ed (A, B) pairs, with the mean of their interval ends."""
    mean = lambda key: float(np.mean(np.array(figures[key], dtype=float)[mask]))
    return f"{mean('utility'):.2f} [{mean('low'):.2f}, {mean('high'):.2f}]"


def _commands(record: dict) -> str:
    measured = record.get("after", {})
    return f"`{record['command']}`; `{measured.get('command', '')}`"


def plasticity_tables(results, workdir: Path) -> list[str]:
    rows = _plasticity(results, workdir)
    models = {k: v for k, v in rows.items() if k.split("/")[1] in PLASTICITY_MODELS}
    metric = "memory_accuracy"
    head = ["model", "ACC", "BWT", "FWT", "forgetting (max)", "forgetting (first-last)", "LCA"]
    head += ["U fast, same task", "U fast, other tasks", "U slow, same task", "U slow, other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    matrices = []
    for row_id, (record, result) in models.items():
        name = row_id.removeprefix("plasticity/")
        failed = _failed(record, result)
        if failed:
            lines.append(f"| {name} | {failed} |" + " |" * (len(head) - 2))
            continue
        summary = result["transfer"]["summary"][metric]
        keys = ("average_accuracy", "backward_transfer", "forward_transfer", "forgetting_max")
        keys += ("forgetting_first_last", "learning_curve_area")
        cells = [_pct(summary.get(k)) for k in keys]
        for kind in ("fast", "slow"):
            figures = result["regret"][kind]
            same = np.eye(len(figures["utility"]), dtype=bool)
            cells += [_ci(figures, same), _ci(figures, ~same)]
        lines.append("| " + " | ".join([name, *cells]) + " |")
        R = np.array(result["transfer"]["R"][metric], dtype=float)
        b = np.array(result["transfer"]["b"][metric], dtype=float)
        matrices.append(
            f"* {name}: before any phase {_row(b)}; "
            + "; ".join(
                f"after task {t} {_row(r)}"
                for t, r in zip(result["transfer"]["tasks"], R, strict=True)
            )
        )
    commands = [f"* {k.removeprefix('plasticity/')}: {_commands(v[0])}" for k, v in models.items()]
    return lines + ["", "R (from-memory accuracy on tasks 0..3, %):", "", *matrices, "", *commands]


def _row(values) -> str:
    return "[" + ", ".join(f"{100 * v:.1f}" for v in values) + "]"


def alignment_table(results, workdir: Path) -> list[str]:
    rows = _plasticity(results, workdir)
    head = ["level", "form", "cos(grad J, g) trained", "initial", "conflict rate trained"]
    head += ["initial", "total update trained", "initial", "command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row_id, (record, result) in rows.items():
        name = row_id.removeprefix("plasticity/")
        if name not in ALIGNMENT_RULES:
            continue
        failed = _failed(record, result) or (result["alignment"].get("error") and "**failed**")
        if failed:
            lines.append(f"| {name} | {failed} |" + " |" * (len(head) - 2))
            continue
        for form in ("through_scan", "one_step"):
            trained = result["alignment"]["trained"][form]["levels"]["memory"]
            initial = result["alignment"]["initial"][form]["levels"]["memory"]
            cells = [
                f"{trained['cos_local']:.4f}",
                f"{initial['cos_local']:.4f}",
                f"{trained['conflict_local']:.2f}",
                f"{initial['conflict_local']:.2f}",
                f"{trained['total_update']:.3g}",
                f"{initial['total_update']:.3g}",
            ]
            lines.append("| " + " | ".join([name, form, *cells, _commands(record)]) + " |")
    return lines


def plasticity_section(results, workdir: Path) -> list[str]:
    """The "Functional plasticity" section's lines."""
    return [
        "## Functional plasticity",
        "",
        "Each model trained, then deployed on held-out agents by `experiments/plasticity.py` "
        "(slow weights frozen, every batch row one agent, the fast state carried from session "
        "to session; `nested.plasticity`). Models of `configs/continual.py` with equal "
        "slow-parameter count (81k; Hope 81.3k), trained on agents (a new agent every 32 "
        "batches, its four tasks switching every 8, half the keys remapped at each switch). "
        "Continual-learning metrics on from-memory accuracy (%), tasks 0..3 in turn, each "
        "phase 4 sessions of 2 sequences: ACC, BWT, FWT (GEM), forgetting (max-based, "
        "Chaudhry et al. 2018; first minus last), LCA (A-GEM, over the phase's sessions). "
        "Regret utility U(A, B): the drop of the summed online loss (nats per scored token, "
        "summed over a session's 2 sequences) of a session on task B after a session on A "
        "(fast) or 5 Adam steps on A (slow), mean over pairs with the mean 95% bootstrap "
        "interval over agents.",
        "",
        *plasticity_tables(results, workdir),
        "",
        "Alignment of a TTT-style level's updates with the outer loss of the rest of the "
        "sequence (`configs/mqar.py`, held-out batch of 16 rows): mean cosine of `grad J` with "
        "the local gradient `g`, fraction of updates with `<grad J, g> < 0`, and the first-order "
        "gain of scaling all of the level's updates up (`total_update`), for the trained "
        "weights and the initial weights of the same config.",
        "",
        *alignment_table(results, workdir),
        "",
    ]


def _by_model(results, workdir: Path, stream: str) -> dict[str, list[tuple[dict, dict | None]]]:
    """``{variant: [(row record, plasticity.json or None) per seed]}`` of a stream's rows."""
    out: dict[str, list] = {}
    for row_id, (record, _) in results.items():
        if row_id.startswith(f"{stream}/"):
            path = workdir / row_id / "plasticity.json"
            result = json.loads(path.read_text()) if path.exists() else None
            out.setdefault(row_id.split("/")[1], []).append((record, result))
    return {m: out[m] for m in FREQUENCY_STREAMS[stream][0] if m in out}


def _over_seeds(values: list[float], spread: bool = True) -> str:
    """Mean over seeds in %, with the range over seeds."""
    if not values:
        return "—"
    mean = f"{100 * float(np.mean(values)):.1f}"
    if not spread or len(values) < 2:
        return mean
    return f"{mean} [{100 * min(values):.1f}, {100 * max(values):.1f}]"


def _tracking(settings: dict, overrides) -> np.ndarray:
    """The continual stream's tracking matrix (``transfer.tracking_matrix``) over the held-out
    agents ``experiments/plasticity.py`` deploys with ``settings``, the stream's task fields
    set by the ``task.`` overrides."""
    task = nc.build(nc.load("configs/continual.py:one_level")).task
    fields = {k.removeprefix("task."): v for k, v in overrides if k.startswith("task.")}
    task = dataclasses.replace(task, seed=task.seed + settings["agent_seed"], **fields)
    rows = range(settings["batch_size"])
    tasks = range(task.num_tasks)
    mappings = [[task.mapping(j, r, -1) for j in tasks] for r in rows]
    return transfer.tracking_matrix(mappings, [task.keys(j) for j in tasks])


def _kept(R: np.ndarray, A: np.ndarray) -> float:
    """Accuracy on earlier tasks beyond what their unchanged keys explain: the mean over
    ``i > j`` of ``R[i, j] - A[i, j] R[j, j]``, answers only a memory of old values gives."""
    below = np.tril(np.ones_like(R, dtype=bool), -1)
    return float(np.mean((R - A * np.diag(R)[None, :])[below]))


def _frequency_table(models, overrides) -> tuple[list[str], list[str], list[str], str | None]:
    """One stream's table of the multi-frequency models (``_by_model``; the stream's config
    ``overrides``): its lines with the verdicts after it, the per-seed intervals, the
    commands, and the two-level model of best BWT (None without one). "train wall": the
    training command's wall time, mean over the seeds."""
    metric = "memory_accuracy"
    head = ["model", "slow params", "carried bytes", "seeds", "train wall", "ACC", "BWT", "FWT"]
    head += ["forgetting (max)", "old values kept", "in-context ACC"]
    head += ["task 0 after 1 / 2 / 3 later tasks"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    settings = next(
        (r["settings"] for runs in models.values() for _, r in runs if r is not None), None
    )
    A = None if settings is None else _tracking(settings, overrides)
    if A is not None:
        ideal = transfer.summary(A, np.zeros(len(A)))
        cells = ["current-mapping tracker (ideal)", "", "", "", ""]
        cells += [f"{100 * ideal[k]:.1f}" for k in ("average_accuracy", "backward_transfer")]
        cells += [f"{100 * ideal['forward_transfer']:.1f}", f"{100 * ideal['forgetting_max']:.1f}"]
        cells += ["0.0", "", " / ".join(f"{100 * v:.1f}" for v in A[1:, 0])]
        lines.append("| " + " | ".join(cells) + " |")
    details, commands, figures = [], [], {}
    for model, runs in models.items():
        done = [result for _, result in runs if result is not None and "transfer" in result]
        walls = [record["wall_s"] for record, r in runs if r is not None and "transfer" in r]
        failed = [_failed(record, result) for record, result in runs if result is None]
        if not done:
            lines.append(f"| {model} | {failed[0] if failed else '—'} |" + " |" * (len(head) - 2))
            continue
        spent = done[0]["budget"]
        summaries = [r["transfer"]["summary"][metric] for r in done]
        get = lambda key, summaries=summaries: [s[key] for s in summaries]
        in_context = [r["transfer"]["summary"]["in_context_accuracy"] for r in done]
        R0 = np.array([np.array(r["transfer"]["R"][metric], dtype=float)[1:, 0] for r in done])
        absence = " / ".join(f"{100 * v:.1f}" for v in R0.mean(axis=0))
        figures[model] = (
            float(np.mean(get("average_accuracy"))),
            float(np.mean(get("backward_transfer"))),
        )
        cells = [
            model,
            f"{spent['slow_parameters']:,}",
            f"{spent['carried_bytes']:,}",
            str(len(done)),
            f"{np.mean(walls):.0f} s",
            _over_seeds(get("average_accuracy")),
            _over_seeds(get("backward_transfer")),
            _over_seeds(get("forward_transfer"), spread=False),
            _over_seeds(get("forgetting_max"), spread=False),
            _over_seeds(
                [_kept(np.array(r["transfer"]["R"][metric], dtype=float), A) for r in done]
            ),
            _over_seeds([s["average_accuracy"] for s in in_context]),
            absence,
        ]
        lines.append("| " + " | ".join(cells) + " |")
        intervals = [
            r["transfer"]["intervals"][metric].get("backward_transfer")
            for r in done
            if r["transfer"].get("intervals", {}).get(metric)
        ]
        if intervals:
            details.append(
                f"* {model}: BWT per seed with its 95% interval over agents: "
                + "; ".join(
                    f"{100 * m:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" for m, lo, hi in intervals
                )
            )
        others = ", ".join(f"`{k}`" for k in range(1, len(runs)))
        more = f" (`--config.seed=` {others} for the others)" if len(runs) > 1 else ""
        commands.append(f"* {model}: {_commands(runs[0][0])}{more}")
    verdict, best = [], None
    base = figures.get("one_level_wide")
    multi = {m: f for m, f in figures.items() if m.startswith(("periods_", "consolidate_"))}
    if base and multi:
        best = max(multi, key=lambda m: multi[m][1])
        acc, bwt = multi[best]
        verdict = [
            f"Best BWT of the two-level models: {best}, {100 * bwt:.1f} against "
            f"{100 * base[1]:.1f} for one_level_wide at equal bytes "
            f"({100 * (bwt - base[1]):+.1f} points; the goal is +20 at an ACC no lower), "
            f"ACC {100 * acc:.1f} against {100 * base[0]:.1f}.",
            "",
        ]
    if "three_level" in figures and "one_level_wider" in figures:
        (acc, bwt), (acc1, bwt1) = figures["three_level"], figures["one_level_wider"]
        verdict += [
            f"Three levels: BWT {100 * bwt:.1f} against {100 * bwt1:.1f} for one_level_wider "
            f"at equal bytes ({100 * (bwt - bwt1):+.1f} points), ACC {100 * acc:.1f} against "
            f"{100 * acc1:.1f}.",
            "",
        ]
    return [*lines, "", *verdict], details, commands, best


# What each multi-frequency stream's section says before its table.
_DISJOINT_FLAGS = " ".join(f"`--config.{k}={v}`" for k, v in DISJOINT)
STREAM_INTROS = {
    "frequencies": (
        "Do memories updated at several frequencies forget less than one fast memory? Models of "
        "`configs/continual.py` trained on agents as in the section above, each with the same "
        "DeltaNet memory carried across sequences (two heads of 32 x 32 on one layer): "
        "`one_level`, both heads updated every token; `one_level_wide`, its values 48 wide "
        "and its MLP narrowed, at the bytes of the two-level models; `periods_1_C`, the second "
        "head a slow level learning the same key-value stream, its updates summed and applied "
        "every C tokens (`levels.slow.accumulate`, periods across sequences of 48 tokens); "
        "`consolidate_1_C`, the slow head learning instead the fast head's keys and its reads "
        "of them (`model.consolidate`: the slow memory learns to reproduce the fast one); "
        "`three_level`, three heads at periods {1, 16, 256}, each slower one consolidating the "
        "one before, against `one_level_wider` at its bytes (both at 93k parameters); "
        "`hope_carried`, Hope with its memory and projections carried. The slow levels' step "
        "sizes are gates of the outer loop (learned). Deployed on held-out agents by "
        "`experiments/plasticity.py --protocols=transfer` (16 agents, 4 sessions of 2 "
        "sequences per task): from-memory accuracy (%) of the R matrix, mean over the training "
        "seeds [range over seeds]; in-context accuracy over all phases; task 0's from-memory "
        "accuracy after 1, 2 and 3 later tasks (mean over seeds). The budget is printed by "
        "the experiment (`nested.plasticity.budget`). Each task switch gives half the keys new "
        "values, so part of the forgetting is forced: the first row is an ideal learner of the "
        "current mapping alone (`nested.plasticity.transfer.tracking_matrix`: R[i, j] the share "
        "of task j's keys task i left unchanged, computed from the agents' mappings). 'Old "
        "values kept' is what no tracker scores: the mean over earlier tasks of R[i, j] - "
        "A[i, j] R[j, j] (A the tracker's matrix), the answers on keys whose value changed "
        "since, which only a memory of the old values gives. `consolidate_1_32_lr<value>`: "
        "consolidate_1_32 with the slow head's step size fixed at the value "
        "(`--config.levels.slow.lr`) instead of the gate beta_t the outer loop learns."
    ),
    "frequencies_disjoint": (
        "The same models, training and deployment on the stream whose every task has keys of "
        f"its own (`task.disjoint_keys`: {_DISJOINT_FLAGS}; 4 tasks of 32 keys): no later "
        "task changes an earlier task's answers, so a memory that kept every pair would score "
        "R[i, j] = "
        "R[j, j] (BWT 0) and whatever is lost is interference in the model's own state. The "
        "tracker of the current mapping recalls no earlier task here (its R is the identity), "
        "so 'old values kept' is the mean from-memory accuracy on earlier tasks."
    ),
    "frequencies_review": (
        "The stream of the section above with the last 4 of the 8 training queries of every "
        "sequence on keys of the tasks the agent met earlier (`--config.task.review_queries=4`), "
        "so the training loss rewards keeping them; deployment and R as above (eval batches "
        "have no review queries). `consolidate_1_32_lr<value>`: consolidate_1_32 with the "
        "slow head's step size fixed at the value (`--config.levels.slow.lr`) instead of the "
        "gate beta_t the outer loop learns. One training seed."
    ),
    "frequencies_load": (
        "The disjoint stream with 8 keys a task and 4 of them presented a sequence "
        "(`--config.task.num_keys=8` `--config.task.num_pairs=4`): the four tasks' 32 pairs "
        "are what one 32 x 32 head stores without interference, so a memory that loses them "
        "here does so by its learned gates and steps, not for want of room. Deployment and R "
        "as in the disjoint section."
    ),
}


def frequency_section(results, workdir: Path, stream: str) -> list[str]:
    """A multi-frequency stream's section (:data:`FREQUENCY_STREAMS`): its introduction, the
    table of its rows with the seeds' details, the level ablation, the alignment over a task
    switch and the commands (none until one of its rows is measured)."""
    models = _by_model(results, workdir, stream)
    if not models:
        return []
    table, details, commands, best = _frequency_table(models, FREQUENCY_STREAMS[stream][1])
    return [
        f"## {SECTIONS[stream]}",
        "",
        STREAM_INTROS[stream],
        "",
        *table,
        *details,
        "",
        *_ablation(models, workdir, stream),
        *_switch(models, workdir, stream, shown=best),
        *commands,
        "",
    ]


def _ablation(models, workdir: Path, stream: str) -> list[str]:
    """Where retention lives: the first seed of each multi-level model of ``stream`` deployed
    again with one level restarted after every phase (``plasticity_reset_<level>.json``, when
    measured)."""
    lines = []
    for model in models:
        run = workdir / stream / model / f"seed{FREQUENCY_SEEDS[0]}"
        for level in ("memory", "mid", "slow"):
            path = run / f"plasticity_reset_{level}.json"
            if not path.exists():
                continue
            summary = json.loads(path.read_text())["transfer"]["summary"]["memory_accuracy"]
            cells = [_pct(summary[k]) for k in ("average_accuracy", "backward_transfer")]
            lines.append(f"| {model} | {level} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    run = f"runs/results/{stream}/MODEL/seed0"
    command = (
        f"`python experiments/plasticity.py --workdir={run} --sessions=4 --session_length=2 "
        f"--protocols=transfer --reset_levels=LEVEL --out={run}/plasticity_reset_LEVEL.json`"
    )
    return [
        "Where retention lives (seed 0): from-memory ACC and BWT (%) with one level restarted "
        f"after every phase ({command}); `memory` is the fast head's level, `slow` the slow "
        "head's.",
        "",
        "| model | level restarted | ACC | BWT |",
        "|---|---|---|---|",
        *lines,
        "",
    ]


SWITCH_FIGURE = "benchmarks/figures/{stream}_switch.png"  # committed beside RESULTS.md


def _switch(models, workdir: Path, stream: str, shown: str | None = None) -> list[str]:
    """Per-level alignment over a task switch (``report._switch``) of the first seed of each
    model of ``stream`` measured by the alignment protocol (``plasticity_switch.json``), and
    the figure of ``shown`` (the best two-level model; else the first measured) copied to
    :data:`SWITCH_FIGURE` of the stream."""
    figure_path = SWITCH_FIGURE.format(stream=stream)
    lines, plots = [], {}
    for model in models:
        run = workdir / stream / model / f"seed{FREQUENCY_SEEDS[0]}"
        path = run / "plasticity_switch.json"
        if not path.exists():
            continue
        switch = json.loads(path.read_text())["alignment"].get("switch")
        if switch is None:
            continue
        for level, old in switch["old_task"]["levels"].items():
            new = switch["new_task"]["levels"][level]
            shown_as = lambda key, spec: [  # None: the level made no update in the batch
                "—" if f[key] is None else format(f[key], spec) for f in (new, old)
            ]
            cells = shown_as("cos_update", ".3f") + shown_as("total_update", ".3g")
            cells += shown_as("conflict_update", ".2f")
            lines.append(f"| {model} | {level} | " + " | ".join(cells) + " |")
        if (run / "plasticity_switch.png").exists():
            plots[model] = run / "plasticity_switch.png"
    if not lines:
        return []
    shown = shown if shown in plots else next(iter(plots), None)
    run = f"runs/results/{stream}/MODEL/seed0"
    command = (
        f"`python experiments/plasticity.py --workdir={run} --protocols=alignment "
        f"--out={run}/plasticity_switch.json`"
    )
    out = [
        "Alignment over a task switch (seed 0; "
        f"{command}): from the state a held-out batch of task 0 leaves, each level's updates "
        "on the first batch of task 1, against that batch's own loss (new) and against a "
        "later batch of task 0 run after it (old): the mean cosine of grad J with the update, "
        "the first-order change of -J if all of the level's updates grew by a factor 1 + e "
        "(d(-J)/de: positive helps), and the share of updates that raise J.",
        "",
        "| model | level | cos new | cos old | d(-J)/de new | d(-J)/de old | conflict new | "
        "conflict old |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]
    if shown is not None:
        (ROOT / figure_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plots[shown], ROOT / figure_path)
        out += [f"![alignment by position over a task switch, {shown}]({figure_path})", ""]
    return out


def companion_section(results, workdir: Path) -> list[str]:
    """The "Agent companion" section's lines (``companion_study.json`` of the companion rows):
    the per-session table of every method, the bytes of each, the logistic learner's tuning,
    and the variants' table (:func:`companion_variants_table`)."""
    out = [
        "## Agent companion",
        "",
        "`configs/companion.py` trained on training agents, then `experiments/companion_study.py`"
        " on held-out agents (another seed): each method sees the same events session by "
        "session and answers the same queries after each session "
        "(`experiments/studies/companion`). "
        "The companion's fast state sets the bytes per agent every equal-bytes baseline is held "
        "to: `knn`/`knn_recency` keep as many (input, answer) pairs with 64-dim keys (the "
        "trained model's token embeddings, averaged and normalised) as fit; `raw_overlap` "
        "keeps raw events (feature ids and answer, a byte each: every event fits) and answers "
        "with the stored event sharing the most feature ids, the most recent among ties; "
        "`logistic` is multinomial logistic regression on the one-hot features trained online "
        "(one SGD step per event, learning rate tuned on training agents only); `votes` counts "
        "answers per feature and answers the label of most summed counts. `knn_unbounded` "
        "keeps every pair, `oracle` refits logistic regression offline on every event seen. "
        "Accuracy (%) on novel queries (inputs the agent never showed) after each session, "
        "mean and 95% bootstrap interval over agents; the rule drifts at the session marked "
        "*; rare facts are rule-breaking answers shown once at the start; stale: queries "
        "whose answer the drift changed, answered the old way; regret: errors on the events, "
        "each predicted before it is observed, summed over the sessions.",
        "",
    ]
    for row_id, (record, _) in results.items():
        if not row_id.startswith("companion/"):
            continue
        path = workdir / row_id / "companion_study.json"
        result = json.loads(path.read_text()) if path.exists() else None
        failed = _failed(record, result)
        if failed:
            out += [f"{row_id}: {failed}", ""]
            continue
        drift = result["task"]["drift_session"]
        sessions = len(next(iter(result["sessions"].values()))["novel"]["mean"])
        head = ["method"] + [f"{s + 1}{'*' if s == drift else ''}" for s in range(sessions)]
        head += ["facts (end)", "stale (end)", "recovers in", "regret"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, rows in result["sessions"].items():
            novel = rows["novel"]
            cells = [
                f"{100 * m:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"
                for m, lo, hi in zip(novel["mean"], novel["low"], novel["high"], strict=True)
            ]
            recover = result["summary"][method]["recover"].get("sessions")
            cells += [
                f"{100 * rows['facts']['mean'][-1]:.1f}",
                f"{100 * rows['stale']['mean'][-1]:.1f}",
                "—" if recover is None else f"{recover} session(s)",
                f"{rows['regret']['mean'][-1]:.1f}",
            ]
            out.append("| " + " | ".join([method, *cells]) + " |")
        size, latency = result["bytes"], result["latency"]
        each = size.get("methods", {})
        listed = ", ".join(f"`{m}` {b}" for m, b in each.items() if m != "companion")
        out += [
            "",
            f"Bytes per agent: {size['companion']} (the companion's fast state; `knn` keeps "
            f"{size['knn_capacity']} pairs in as many"
            + (f", `raw_overlap` {size['raw_capacity']} events" if "raw_capacity" in size else "")
            + (f"; each method's memory: {listed}" if listed else "")
            + "). Latency of the service's calls at "
            f"{latency['agents']} agents at once (in process, median): observe "
            f"{1e3 * latency['observe_s']:.0f} ms, recall {1e3 * latency['recall_s']:.0f} ms.",
        ]
        if "tuning" in result:
            tuning = result["tuning"]
            tried = ", ".join(f"{float(lr):g}: {e:.1f}" for lr, e in tuning["errors"].items())
            out += [
                "",
                f"`logistic`'s learning rate: {tuning['lr']:g}, the fewest test-then-train "
                f"errors per agent's life over {tuning['agents']} training agents (the training "
                f"seed; held-out agents never reach the tuner): {tried}.",
            ]
        out += ["", *companion_variants_table(result), f"* {_commands(record)}", ""]
    return out


def _points(interval: dict | None, percent: bool = False) -> str:
    """``+m [+lo, +hi]`` x100: points to a tenth, or a percentage (``percent``); ``—`` for
    None."""
    if interval is None:
        return "—"
    m, lo, hi = (100 * interval[k] for k in ("mean", "low", "high"))
    if percent:
        return f"{m:+.0f}% [{lo:+.0f}, {hi:+.0f}]"
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def companion_variants_table(result: dict) -> list[str]:
    """The variants' lines of a companion study: per variant, each method's novel accuracy
    averaged over the sessions, the companion's advantage over `knn` and over the best
    equal-bytes baseline, and the share of the standard agents' advantage that survives;
    nothing for a study without variants."""
    variants = result.get("variants")
    if not variants:
        return []
    methods = list(next(iter(variants.values()))["novel"])
    head = ["variant", "k", "rule", *methods, "companion − knn", "companion − best (which)"]
    head += ["survives vs knn", "survives vs best"]
    out = [
        "Held-out agents unlike the training agents, the same trained model and baselines "
        "(`--variants`): `k2`/`k4` 2 and 4 features per input instead of 3; `one_feature` "
        "the same votes with weights 2^rank, so the input's highest-ranked feature decides "
        "alone; `pairs` every feature pair votes for a label (no linear map of the one-hot "
        "features computes it). Novel accuracy (%) averaged over the sessions, mean and 95% "
        "bootstrap interval over agents; companion − m: the paired difference in points; best: "
        "the equal-bytes baseline (`knn`, `knn_recency`, `raw_overlap`, `logistic`, `votes`) "
        "of the highest accuracy in that variant; survives: the advantage over that method "
        "as a share of the standard agents' (— where the companion has none there), "
        "resampled in pairs of agents.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, row in variants.items():
        best = row["best"]
        cells = [name, str(row["task"]["features_per_input"]), row["task"]["rule_kind"]]
        cells += [
            f"{100 * v['mean']:.1f} [{100 * v['low']:.0f}, {100 * v['high']:.0f}]"
            for v in row["novel"].values()
        ]
        cells += [_points(row["advantage"]["knn"]), f"{_points(row['advantage'][best])} ({best})"]
        survives = row.get("survives")
        cells += (
            ["(reference)", "(reference)"]
            if survives is None
            else [_points(survives["knn"], True), _points(survives[best], True)]
        )
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


LM_CURVES = "benchmarks/figures/lm_real_text.png"  # committed beside RESULTS.md


def lm_section(results, workdir: Path) -> list[str]:
    """The "Language modelling on real text" section's lines (``eval_lm.json`` of the ``lm/``
    rows) and the plot of their training and validation losses (:data:`LM_CURVES`)."""
    entries = {k: v for k, v in results.items() if k.startswith("lm/")}
    evals = {}
    for row_id in entries:
        path = workdir / row_id / "eval_lm.json"
        evals[row_id] = json.loads(path.read_text()) if path.exists() else None
    shown = next((e for e in evals.values() if e), None)
    buckets = [] if shown is None else _lm_buckets(shown["position"])
    head = ["model", "params", "tokens", "wall", "val loss", "perplexity", "bits/byte"]
    head += [f"ppl {lo}-{hi - 1}" for lo, hi in buckets] + ["command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row_id, (record, _) in entries.items():
        result = evals[row_id]
        failed = _failed(record, result)
        model = row_id.split("/", 1)[1]
        if failed:
            lines.append(f"| {model} | {failed} |" + " |" * (len(head) - 2))
            continue
        params = _logged_parameters(workdir / row_id)
        val, position = result["val"], result["position"]
        cells = [
            model,
            "—" if params is None else f"{params / 1e6:.2f}M",
            f"{LM_STEPS * _tokens_per_step(workdir / row_id) / 1e6:.2f}M",
            _wall(record),
            f"{val['nll']:.3f}",
            f"{val['perplexity']:.1f}",
            f"{val['bits_per_byte']:.3f}",
            *(f"{_lm_bucket_ppl(position, lo, hi):.1f}" for lo, hi in buckets),
            _commands(record),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    plot = _lm_curves(entries, workdir)
    out = [
        "## Language modelling on real text",
        "",
        "The Python 3.11 documentation's reStructuredText sources (Debian's `python3-doc`, "
        "written by the CPython documentation authors: 497 files, 11 MB), tokenized by "
        f"`{' '.join(LM_PREPARE)}` (a byte-level BPE of 8192 trained on the corpus; 5% of the "
        "files held out by hash). Each model is `configs/lm.py`'s `small` size (4 blocks of "
        "width 256, parameters within 10% of the Transformer++'s), trained on the same "
        f"{LM_STEPS} batches of 16 x 256 tokens in the same order (documents packed without "
        f"restarts, `{LM_DOCUMENTS[0]}={LM_DOCUMENTS[1]}`, as flame trains by default), "
        "then scored by "
        "`experiments/eval_lm.py` on every held-out token: loss (nats per token), perplexity, "
        "bits per byte (comparable across tokenizers), and perplexity by position in windows "
        "of 1024 from a fresh state: positions past 255 are beyond the trained length.",
        "",
        *lines,
        "",
    ]
    if plot:
        out += [
            f"![training and held-out loss by training tokens]({LM_CURVES})",
            "",
            "Points: the training loop's held-out loss on the first 16 validation batches (65k "
            "tokens); the table scores all of them.",
            "",
        ]
    return out


def _logged_parameters(workdir: Path) -> int | None:
    """The slow-parameter count the training run logged (``model: N slow parameters``)."""
    path = workdir / "train.stderr.txt"
    found = re.search(r"model: (\d+) slow parameters", path.read_text()) if path.exists() else None
    return None if found is None else int(found.group(1))


def _lm_buckets(position: dict) -> list[tuple[int, int]]:
    """Position ranges of the table: the trained length in halves, then each further length."""
    t, end = position["trained_len"], position["max_len"]
    return [(0, t // 2), (t // 2, t), *((lo, lo + t) for lo in range(t, end, t))]


def _lm_bucket_ppl(position: dict, lo: int, hi: int) -> float:
    return float(np.exp(np.mean(position["nll"][lo:hi])))


def _tokens_per_step(workdir: Path) -> int:
    """Training tokens a step of the run in ``workdir`` (its ``config.json``)."""
    config = json.loads((workdir / "config.json").read_text())
    return config["train"]["batch_size"] * config["task"]["seq_len"]


def _lm_curves(entries, workdir: Path) -> str | None:
    """Plot every ``lm/`` row's training loss (points: held-out loss) against tokens."""
    if not entries:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row_id, (_, records) in entries.items():
        train_records = [r for r in records if r["split"] == metrics.TRAIN]
        held = [r for r in records if r["split"] == "val" and "loss" in r]
        tokens = _tokens_per_step(workdir / row_id)
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
    path = ROOT / LM_CURVES
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def markdown(results, workdir: Path, row_notes: dict[str, str], observations: str = "") -> str:
    """The results page; ``observations`` (a hand-written ``## Observations`` section, kept
    from the previous page) goes after the introduction."""
    notes = sorted(
        {
            f"`{k.split('/')[1].rsplit('_d', 1)[0]}`: {v}"
            for k, v in row_notes.items()
            if v and k.startswith("mqar/")
        }
    )
    out = [
        "# Results",
        "",
        "Produced by `python benchmarks/results.py --out RESULTS.md` (each row's command is next "
        "to it; `python` is the repository's virtual environment; `--only REGEX` reruns some "
        "rows, `--widths 64` the MQAR rows at one width). Machine: "
        f"{report.machine()}, shared with other jobs; table written {report.utc_now()}; "
        "wall time is the whole command: compilation, training and evaluation. Accuracies are "
        "percentages on held-out batches after the last training step. A row absent from a "
        "table was not run.",
        "",
        *([observations.strip(), ""] if observations.strip() else []),
        "## MQAR (multi-query associative recall)",
        "",
        "`configs/mqar.py`: one-layer model, vocabulary 256, trained on sequences of 64 tokens "
        "with 4, 8 and 16 key-value pairs; tested on those and on 128 tokens with 32 pairs "
        "(twice the trained length and pairs). Test accuracy on query positions.",
        "",
        *mqar_table(results),
        "",
    ]
    if notes:
        out += ["Overrides to fit the CPU budget: " + "; ".join(notes) + ".", ""]
    out += [
        "## Character-level language modelling",
        "",
        "`configs/char_lm.py`: bytes of the Python standard library's sources, sequences of 128, "
        "two layers of width 128; bits per character on held-out files. "
        f"Trained {CHAR_LM_STEPS} steps (batch 16: about {CHAR_LM_STEPS * 16 * 128 // 1000}k "
        "bytes) instead of the configs' 3000, to fit the CPU budget.",
        "",
        *char_lm_table(results, row_notes),
        "",
        "## Needle in a haystack",
        "",
        "`configs/niah.py`: trained on contexts of 64 tokens, tested on 64, 256 and 1024.",
        "",
        *niah_table(results),
        "",
        "## Continual key-value stream",
        "",
        "`configs/continual.py`: four tasks in turn, each for `switch_every` steps, every batch "
        "row with its own key-value mappings (slow weights cannot memorise them); the memory "
        "keeps its fast state across sequences. Per task, at the end of training: accuracy on "
        "all queries, on queries whose key is in the sequence (in-context) and on the others "
        "(from memory: only what persisted can answer). Forgetting: from-memory accuracy at "
        "the end of the task's own phase minus at the end of training.",
        "",
        *continual_table(results, workdir),
        "",
        *plasticity_section(results, workdir),
        *(
            line
            for stream in FREQUENCY_STREAMS
            for line in frequency_section(results, workdir, stream)
        ),
        *companion_section(results, workdir),
        *lm_section(results, workdir),
    ]
    return "\n".join(out)


def main(argv):
    del argv
    workdir = Path(FLAGS.workdir)
    table = rows([int(w) for w in FLAGS.widths])
    chosen = [r for r in table if FLAGS.only is None or re.search(FLAGS.only, r.id)]
    if not FLAGS.dry_run and any(r.id.startswith("lm/") for r in chosen):
        prepare_lm_corpus()
    for i, row in enumerate(chosen, 1):
        directory = workdir / row.id
        if FLAGS.dry_run:
            print(" ".join(command(row, directory)))
            continue
        done = (ROOT / directory / ROW_FILE).exists()
        if done and not FLAGS.rerun:
            print(f"[{i}/{len(chosen)}] {row.id}: kept (--rerun to run again)", flush=True)
            continue
        print(f"[{i}/{len(chosen)}] {row.id}: {' '.join(command(row, directory))}", flush=True)
        record = run_row(row, directory, FLAGS.timeout)
        print(f"    {record['wall_s']:.0f} s, exit status {record['status']}", flush=True)
        if record["error"]:
            print(f"    {record['error']}", flush=True)
    if FLAGS.dry_run:
        return
    base = ROOT / workdir
    results = {}
    for row in table:
        record, records = _load(base / row.id)
        if record is not None:
            results[row.id] = (record, records)
    out = ROOT / FLAGS.out
    previous = out.read_text() if out.exists() else ""
    if FLAGS.sections:
        text = previous
        for name in FLAGS.sections:
            build = {
                "plasticity": plasticity_section,
                "companion": companion_section,
                "lm": lm_section,
                **{s: partial(frequency_section, stream=s) for s in FREQUENCY_STREAMS},
            }[name]
            section = "\n".join(build(results, base)).strip() + "\n\n"
            title = re.escape(SECTIONS[name])
            pattern = re.compile(rf"^## {title}\n.*?(?=^## |\Z)", re.M | re.S)
            if pattern.search(text):
                text = pattern.sub(lambda _: section, text)
            else:
                text = text.rstrip() + "\n\n" + section
        out.write_text(text.rstrip() + "\n")
        print(f"wrote the sections {FLAGS.sections} of {out}")
        return
    observations = re.search(r"^## Observations\n.*?(?=^## |\Z)", previous, re.M | re.S)
    text = markdown(
        results,
        base,
        {r.id: r.note for r in table},
        observations.group(0) if observations else "",
    )
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
