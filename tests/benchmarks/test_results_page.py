"""RESULTS.md as ``benchmarks/results.py`` renders it: every section from small synthetic
workdirs (``row.json``, ``metrics.jsonl`` and the measurement files each section reads),
compared byte for byte with ``results_page.md`` (the page the renderer gave before it was
split into ``benchmarks/sections``); the sections' prose as the committed RESULTS.md has it;
and the commands of ``--dry_run``."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).with_name("results_page.md")


def _write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value) if not isinstance(value, str) else value)


def _row(workdir: Path, row_id: str, wall: float, records=(), error=None, after=True, files=None):
    """A row's workdir: its ``row.json`` (a failed run where ``error``; an ``after`` command
    where ``after``), ``metrics.jsonl`` of ``records`` and ``files`` ``{name: content}``."""
    run = workdir / row_id
    record = {"command": f"python train {row_id}", "wall_s": wall, "status": 0, "error": None}
    if error:
        record.update(status=1, error=error)
    elif after:
        record["after"] = {"command": f"python after {row_id}", "status": 0, "error": None}
    _write(run / "row.json", record)
    _write(run / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    for name, value in (files or {}).items():
        _write(run / name, value)


def _evals(step: int, **splits) -> list[dict]:
    return [{"step": step, "split": s, **values} for s, values in splits.items()]


def _interval(mean: float) -> dict:
    return {"mean": mean, "low": mean - 0.05, "high": mean + 0.04}


def _transfer(seed: int) -> dict:
    """A plasticity.json ``transfer`` of four tasks, shifted by ``seed``."""
    R = (np.tril(np.full((4, 4), 0.4)) + np.diag([0.5, 0.45, 0.4, 0.35]) - 0.01 * seed).tolist()
    summary = {
        "average_accuracy": 0.61 + 0.01 * seed,
        "backward_transfer": -0.2 + 0.02 * seed,
        "forward_transfer": 0.03,
        "forgetting_max": 0.25,
        "forgetting_first_last": 0.2,
        "learning_curve_area": 0.5,
    }
    return {
        "tasks": [0, 1, 2, 3],
        "R": {"memory_accuracy": R},
        "b": {"memory_accuracy": [0.1, 0.12, 0.09, 0.11]},
        "summary": {"memory_accuracy": summary, "in_context_accuracy": {"average_accuracy": 0.9}},
        "intervals": {"memory_accuracy": {"backward_transfer": [-0.2, -0.25, -0.15]}},
    }


def _alignment_levels(scale: float) -> dict:
    level = {"cos_local": 0.1234 * scale, "conflict_local": 0.31, "total_update": 0.00123 * scale}
    return {form: {"levels": {"memory": level}} for form in ("through_scan", "one_step")}


def _companion() -> dict:
    methods = ("companion", "knn", "raw_overlap", "logistic")
    sessions = {
        m: {
            "novel": {
                "mean": [0.5 + 0.1 * i, 0.6, 0.7],
                "low": [0.4, 0.5, 0.6],
                "high": [0.6, 0.7, 0.8],
            },
            "facts": {"mean": [0.2, 0.3 + 0.1 * i]},
            "stale": {"mean": [0.1, 0.05]},
            "regret": {"mean": [3.0, 7.5 + i]},
        }
        for i, m in enumerate(methods)
    }
    advantage = {m: _interval(0.1) for m in methods[1:]}
    variants = {
        "standard": {
            "task": {"features_per_input": 3, "rule_kind": "linear"},
            "novel": {m: _interval(0.6) for m in methods},
            "advantage": advantage,
            "best": "logistic",
        },
        "pairs": {
            "task": {"features_per_input": 3, "rule_kind": "pairs"},
            "novel": {m: _interval(0.5) for m in methods},
            "advantage": advantage,
            "best": "knn",
            "survives": {"knn": _interval(0.5), "logistic": _interval(0.25)},
        },
    }
    return {
        "task": {"drift_session": 1},
        "sessions": sessions,
        "summary": {m: {"recover": {"sessions": None if m == "knn" else 2}} for m in methods},
        "bytes": {"companion": 4096, "knn_capacity": 30, "raw_capacity": 400, "methods": {}},
        "latency": {"agents": 8, "observe_s": 0.0123, "recall_s": 0.0045},
        "tuning": {"lr": 0.3, "agents": 16, "errors": {"0.1": 12.5, "0.3": 10.25}},
        "variants": variants,
    }


def _eval_lm(shift: float) -> dict:
    nll = [5.0 - 0.001 * t + shift for t in range(1024)]
    val = {"nll": 4.5 + shift, "perplexity": 90.0 + shift, "bits_per_byte": 1.8 + shift}
    return {"val": val, "position": {"trained_len": 256, "max_len": 1024, "nll": nll}}


def write_runs(workdir: Path) -> None:
    """Synthetic workdirs of some rows of every section, failed ones among them."""
    mqar = _evals(800, **{"64x4": {"accuracy": 0.99}, "128x32": {"accuracy": 0.25}})
    _row(workdir, "mqar/delta_d64", 41.2, mqar, after=False)
    _row(workdir, "mqar/titans_d64", 12.0, error="error: out of memory", after=False)
    train = [{"step": s, "split": "train", "loss": 3.0 - s / 100} for s in (100, 200)]
    char = train + _evals(200, val={"bpc": 2.3456, "loss": 1.6})
    _row(workdir, "char_lm/delta", 300.4, char, after=False)
    _row(workdir, "char_lm/titans_mac", 500.0, char, after=False)
    niah = _evals(400, **{"64": {"accuracy": 1.0}, "256": {"accuracy": 0.5}})
    _row(workdir, "niah/delta", 60.0, niah, after=False)
    continual = [
        {"step": s, "split": f"task{k}", "accuracy": 0.5, "memory_accuracy": 0.3 + 0.1 * (s == e)}
        for k, e in enumerate((8, 16)) for s in (8, 16, 24)
    ]  # fmt: skip
    continual[-1]["in_context_accuracy"] = 0.875
    config = {"task": {"switch_every": 8}, "train": {"batch_size": 16}}
    _row(workdir, "continual/delta", 90.0, continual, after=False, files={"config.json": config})
    regret = {"utility": np.eye(4).tolist(), "low": np.zeros((4, 4)).tolist()}
    regret["high"] = (2 * np.eye(4) + 0.5).tolist()
    plasticity = {"transfer": _transfer(0), "regret": {"fast": regret, "slow": regret}}
    _row(workdir, "plasticity/one_level", 100.0, files={"plasticity.json": plasticity})
    _row(workdir, "plasticity/two_level", 100.0)  # trained, not measured
    alignment = {"trained": _alignment_levels(2.0), "initial": _alignment_levels(1.0)}
    _row(
        workdir, "plasticity/ttt_linear", 50.0, files={"plasticity.json": {"alignment": alignment}}
    )
    _row(workdir, "companion/delta", 70.0, files={"companion_study.json": _companion()})
    budget = {"slow_parameters": 81234, "carried_bytes": 16384}
    settings = {"agent_seed": 1000, "batch_size": 2}
    for stream, models in {
        "frequencies": ("one_level_wide", "periods_1_32", "three_level", "one_level_wider"),
        "frequencies_disjoint": ("one_level", "consolidate_1_32"),
    }.items():
        for i, model in enumerate(models):
            for seed in (0, 1) if i == 0 else (0,):
                result = {"settings": settings, "budget": budget, "transfer": _transfer(seed + i)}
                run = f"{stream}/{model}/seed{seed}"
                _row(workdir, run, 80.0 + seed, files={"plasticity.json": result})
    reset = {"transfer": _transfer(3)}
    _write(workdir / "frequencies/periods_1_32/seed0/plasticity_reset_slow.json", reset)
    levels = {
        "memory": {"cos_update": 0.25, "total_update": 0.5, "conflict_update": 0.4},
        "slow": {"cos_update": None, "total_update": None, "conflict_update": None},
    }
    switch = {
        "alignment": {"switch": {"old_task": {"levels": levels}, "new_task": {"levels": levels}}}
    }
    _write(workdir / "frequencies/periods_1_32/seed0/plasticity_switch.json", switch)
    _write(workdir / "frequencies/periods_1_32/seed0/plasticity_switch.png", "png")
    config = {"task": {"seq_len": 256}, "train": {"batch_size": 16}}
    lm = [{"step": s, "split": "train", "loss": 6.0 - s / 60} for s in (60, 120)]
    lm += _evals(120, val={"loss": 4.4})
    stderr = "I1207 model: 7412345 slow parameters\n"
    for name, shift in (("transformer", 0.0), ("hope", 0.25)):
        run = f"lm/{name}"
        files = {"eval_lm.json": _eval_lm(shift), "train.stderr.txt": stderr, "config.json": config}
        _row(workdir, run, 900.0, lm, files=files)
    _row(
        workdir,
        "lm/titans",
        5.0,
        error="error: task.path: no corpus",
        files={"config.json": config},
    )


RENDER = """
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import report, results
report.machine = lambda: "a test machine"
report.utc_now = lambda: "2026-12-07 12:00 UTC"
tmp = Path(sys.argv[1])
out = tmp / "RESULTS.md"

def run(*flags):
    results.FLAGS.unparse_flags()
    results.FLAGS(["results.py", f"--out={out}", f"--workdir={tmp / 'runs'}", *flags])
    results.main([])

out.write_text("# Results\\n\\n## Observations\\n\\nHand-written.\\n\\n## MQAR\\n")
run("--only=^none$")
full = out.read_text()
(tmp / "full.md").write_text(full)
start, end = full.index("## Functional plasticity"), full.index("## Multi-frequency memory and")
out.write_text(full[:start] + "## Functional plasticity\\n\\nstale\\n\\n" + full[end:])
run("--only=^none$", "--sections=plasticity,lm,frequencies_review")
print("DRY RUN")
run("--dry_run", "--widths=64", "--workdir=runs/results")
"""
# Paragraphs of the page that carry numbers of the synthetic runs, not the templates' prose.
RUN_DATA = ("Produced by", "Hand-written.", "Best BWT", "Three levels:", "Bytes per agent")
RUN_DATA += ("`logistic`'s learning rate",)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, str]:
    """The directory the page was rendered in, and the stdout of the render (the dry run's
    commands after ``DRY RUN``)."""
    tmp = tmp_path_factory.mktemp("results")
    write_runs(tmp / "runs")
    stdout = subprocess.run(
        [sys.executable, "-c", RENDER, str(tmp)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    return tmp, stdout


def test_page_as_before(page):
    """Every section rendered from the synthetic runs, byte for byte as before the split;
    the figures written under the page's directory."""
    tmp, _ = page
    assert (tmp / "full.md").read_text() == EXPECTED.read_text()
    figures = tmp / "benchmarks" / "figures"
    assert (figures / "frequencies_switch.png").read_text() == "png"  # the shown model's
    assert (figures / "lm_real_text.png").read_bytes().startswith(b"\x89PNG")


def test_sections_rewritten(page):
    """``--sections``: the stale section rendered again in its place, a section without rows
    left out, the rest of the page kept."""
    tmp, _ = page
    assert (tmp / "RESULTS.md").read_text() == EXPECTED.read_text()


def test_prose_as_committed(page):
    """The sections' prose paragraphs are RESULTS.md's as committed."""
    committed = (ROOT / "RESULTS.md").read_text()
    paragraphs = [p for p in (page[0] / "full.md").read_text().split("\n\n") if p.strip()]
    prose = [p for p in paragraphs if not p.startswith(("|", "*", "![", *RUN_DATA))]
    assert len(prose) == 27
    assert [p for p in prose if p not in committed] == []


def test_dry_run_commands(page):
    commands = page[1].split("DRY RUN\n", 1)[1].splitlines()
    ids = [c.split("--workdir=runs/results/", 1)[1].split(" ", 1)[0] for c in commands]
    zoology = [i for i in ids if i.startswith("mqar_zoology/")]  # 3 rules x 2 x 3 lrs x 2 seeds
    assert (len(commands) - len(zoology), len(zoology)) == (125, 36)
    assert ids.index("companion/delta") + 1 == ids.index("companion/aligned")
    assert ids.index("companion/aligned") + 1 == ids.index("companion/mixture")
    assert ids.index("companion/mixture") + 1 == ids.index("frequencies/one_level/seed0")
    expected = [
        "python experiments/train.py --config=configs/mqar.py:atlas "
        "--workdir=runs/results/mqar/atlas_d64 --config.model.dim=64 "
        "--config.levels.memory.depth=1 --config.levels.memory.every=8 "
        "--config.train.batch_size=16 --config.train.steps=400",
        "python experiments/train.py --config=configs/continual.py:consolidate_1_32 "
        "--workdir=runs/results/frequencies_review/consolidate_1_32_lr0.3/seed0 "
        "--config.seed=0 --config.task.disjoint_keys=True --config.task.remap_fraction=1.0 "
        "--config.task.vocab_size=288 --config.task.review_queries=4 "
        "--config.levels.slow.lr=0.3",
        "python experiments/train.py --config=configs/lm.py:hope-small "
        "--workdir=runs/results/lm/hope --config.task.path=data/python_docs "
        "--config.train.steps=120 --config.task.documents=False",
    ]
    assert [c for c in expected if c not in commands] == []


def _needle(*tasks: str) -> dict:
    """An eval_lm.json ``needle`` of ``tasks`` at 1K and 2K (accuracy 0.5 and 0.25)."""
    result = lambda acc: {"samples": 32, "accuracy": acc, "low": acc - 0.2, "high": acc + 0.25}
    lengths = {"1024": result(0.5), "2048": result(0.25)}
    return {t: {"new_tokens": 32, "lengths": lengths} for t in tasks}


def test_ruler_section(tmp_path, monkeypatch):
    """The RULER section from the needle results of the lm/ rows' eval_lm.json: a table row per
    model and task (a task a row did not measure: dashes), the figure; no section without any."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from sections import page, rows, ruler

    config = {"task": {"seq_len": 256}, "train": {"batch_size": 16}}
    for name, tasks in (("transformer", ruler.needle.TASKS), ("hope", ("niah_single_1",))):
        result = {**_eval_lm(0.0), "needle": _needle(*tasks)}
        _row(tmp_path, f"lm/{name}", 900.0, files={"eval_lm.json": result, "config.json": config})
    _row(tmp_path, "lm/deltanet", 900.0, files={"eval_lm.json": _eval_lm(0.0)})  # no needle
    runs = rows.Runs(rows.load(page.rows([64]), tmp_path), tmp_path, tmp_path)
    section = page.SECTIONS["ruler"].render(runs)
    assert section.startswith("## RULER single needle\n") and "the 32 needles" in section
    cells = "50.0 [30.0, 75.0] | 25.0 [5.0, 50.0]"
    row = lambda model, task, cells: (
        f"| {model} | `{task}` | {cells} | `python train lm/{model}`; `python after lm/{model}` |"
    )
    assert [line for line in section.splitlines() if line.startswith("|")] == [
        "| model | task | 1K | 2K | command |",
        "|---|---|---|---|---|",
        row("transformer", "niah_single_1", cells),
        row("transformer", "niah_single_2", cells),
        row("hope", "niah_single_1", cells),
        row("hope", "niah_single_2", "— | —"),
    ]
    assert f"![RULER single-needle accuracy against context length]({ruler.FIGURE})" in section
    assert (tmp_path / ruler.FIGURE).read_bytes().startswith(b"\x89PNG")
    bare = rows.Runs(rows.load(page.rows([64]), tmp_path / "none"), tmp_path / "none", tmp_path)
    assert page.SECTIONS["ruler"].render(bare) == ""


# "MQAR at Zoology's settings" (benchmarks/sections/mqar_zoology.py), rendered in-process from
# its own synthetic rows: the best learning rate per (rule, width), its seeds' interval, the
# sweep, the figure, the rows not run.
def _zoology():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from sections import mqar_zoology, page, rows

    return mqar_zoology, page, rows


def _zoology_row(workdir: Path, rule: str, dim: int, lr: float, seed: int, accuracy):
    """A row of the section: ``accuracy`` per test setting (None: the run failed)."""
    section, _, _ = _zoology()
    if accuracy is None:
        _row(workdir, section.row_id(rule, dim, lr, seed), 9.0, error="error: boom", after=False)
        return
    splits = ("seq64_kv4", "seq128_kv8", "seq256_kv16")
    records = _evals(150, **{s: {"accuracy": a} for s, a in zip(splits, accuracy, strict=True)})
    _row(workdir, section.row_id(rule, dim, lr, seed), 100.0 + seed, records, after=False)


@pytest.fixture(scope="module")
def zoology(tmp_path_factory):
    """The section rendered from synthetic rows, and its sweep's best learning rates."""
    section, _, rows = _zoology()
    tmp = tmp_path_factory.mktemp("zoology")
    for rule, dim, lr, seed, accuracy in [
        ("delta", 64, 1e-3, 0, (0.3, 0.2, 0.1)),
        ("delta", 64, 3e-3, 0, (0.8, 0.6, 0.4)),  # the best: mean 0.6
        ("delta", 64, 3e-3, 1, (0.7, 0.6, 0.44)),  # its second seed: mean 0.58
        ("delta", 64, 1e-2, 0, None),  # failed
        ("attention", 64, 1e-3, 0, (0.9, 0.9, 0.9)),  # a tie: the smaller rate
        ("attention", 64, 3e-3, 0, (0.9, 0.9, 0.9)),
        ("attention", 128, 1e-2, 1, (1.0, 1.0, 1.0)),  # seed 1 only: no best
        ("attention", 128, 3e-3, 0, (0.95, 0.95, 0.95)),
    ]:
        _zoology_row(tmp / "runs", rule, dim, lr, seed, accuracy)
    runs = rows.Runs(rows.load(section.rows(), tmp / "runs"), tmp / "runs", tmp)
    return tmp, section.render(runs), section.best_lrs(section._sweep(runs))


def test_zoology_best_learning_rate(zoology):
    """The best of seed 0's runs per (rule, width); a tie goes to the smaller rate."""
    _, _, best = zoology
    assert best == {("delta", 64): 3e-3, ("attention", 64): 1e-3, ("attention", 128): 3e-3}


def test_zoology_section_renders_its_tables_and_figure(zoology):
    tmp, markdown, _ = zoology
    section, page, rows = _zoology()
    lines = markdown.splitlines()
    assert lines[0] == "## MQAR at Zoology's settings"
    # delta d64 at 0.003: two seeds; mean of (0.6, 0.58) +- t(0.975, 1) * 0.01414 / sqrt(2)
    command = "`python train mqar_zoology/delta_d64_lr0.003/seed0`"
    row = "| delta | 64 | 0.003 | 2 | 75.00 | 60.00 | 42.00 | 59.00 [46.29, 71.71] | 100 s |"
    row += f" {command} |"
    assert row in lines
    assert "| attention | 64 | 0.001 | 1 | 90.00 | 90.00 | 90.00 | 90.00 | 100 s |" in markdown
    assert "| delta | 64 | 20.00 | **60.00** | **failed**: error: boom |" in lines
    assert "| attention | 128 | not run | **95.00** | not run |" in lines
    missing = markdown.split("Rows not run", 1)[1].split("\n", 1)[0]
    assert "`gated_delta_d128_lr0.01/seed0`" in missing  # of the sweep
    assert "`attention_d64_lr0.001/seed1`" in missing  # a seed at a best learning rate
    assert "`delta_d64_lr0.003/seed1`" not in missing  # run
    assert "`delta_d64_lr0.001/seed1`" not in missing  # not a best learning rate
    best = r"attention_d64_lr0\.001|attention_d128_lr0\.003|delta_d64_lr0\.003"
    seeds = f"--only='^mqar_zoology/({best})/'"
    assert f"then `python benchmarks/results.py --sections=mqar_zoology {seeds}`" in markdown
    assert (
        f"![MQAR accuracy against model dimension, one panel per test setting]({section.FIGURE})"
        in lines
    )
    assert (tmp / section.FIGURE).read_bytes().startswith(b"\x89PNG")
    assert "mqar_zoology" in page.SECTIONS
    assert set(section.rows()) <= set(page.rows([64]))
    last = section.rows()[-1]
    assert " ".join(rows.command(last, Path("runs/results") / last.id)) == (
        "python experiments/train.py --config=configs/mqar.py:zoology-gated_delta "
        "--workdir=runs/results/mqar_zoology/gated_delta_d128_lr0.01/seed1 --config.seed=1 "
        "--config.model.dim=128 --config.optimizer.learning_rate=0.01 --config.train.steps=50 "
        "--config.train.batch_size=16 --config.optimizer.warmup_steps=5 "
        "--config.train.eval_every=50 --config.train.checkpoint_every=50 "
        "--config.train.eval_batches=1"
    )


def test_zoology_section_is_empty_without_rows(tmp_path):
    section, _, rows = _zoology()
    assert section.render(rows.Runs({}, tmp_path, tmp_path)) == ""


def test_companion_families_row(tmp_path):
    """A study of a run trained on agent families: the variants' table gains whether each
    family was in training and the regret saved against the baseline of least regret, and
    the paragraph that explains both."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sections import companion
    from sections.rows import Runs

    result = _companion()
    for name, row in result["variants"].items():
        row["trained"] = name == "standard"
        row["regret_best"] = "logistic"
        row["regret_saved"] = {m: _interval(2.5) for m in ("knn", "raw_overlap", "logistic")}
    _row(tmp_path, "companion/mixture", 70.0, files={"companion_study.json": result})
    record = json.loads((tmp_path / "companion/mixture/row.json").read_text())
    page = companion.render(Runs({"companion/mixture": (record, [])}, tmp_path, tmp_path))
    table = [line for line in page.splitlines() if line.startswith("| pairs")]
    assert table == [
        "| pairs | 3 | pairs | held out | 50.0 [45, 54] | 50.0 [45, 54] | 50.0 [45, 54] | "
        "50.0 [45, 54] | +10.0 [+5.0, +14.0] | +10.0 [+5.0, +14.0] (knn) | "
        "+2.5 [+2.5, +2.5] (logistic) | +50% [+45, +54] | +50% [+45, +54] |"
    ]
    assert "| standard | 3 | linear | yes |" in page and "In training: whether" in page
