"""The "MQAR (multi-query associative recall)" section: every rule of
``nested.recipes.RULES`` at each model width, and the Hope variant, on ``configs/mqar.py``;
test accuracy per test setting and their mean."""

from __future__ import annotations

from collections.abc import Sequence

from nested.levels import recipes
from nested.run import metrics
from sections import text
from sections.rows import Row, Runs, Section

WIDTHS = (64, 128)
# Rows whose defaults do not fit a few minutes of two shared CPU cores, and why.
OVERRIDES: dict[str, tuple[tuple[tuple[str, object], ...], str]] = {
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


def rows(widths: Sequence[int] = WIDTHS) -> list[Row]:
    out = []
    for rule in sorted(recipes.RULES):
        overrides, note = OVERRIDES.get(rule, ((), ""))
        for dim in widths:
            config = f"configs/mqar.py:{rule}"
            out.append(Row(f"mqar/{rule}_d{dim}", config, (("model.dim", dim), *overrides), note))
    for dim in widths:
        out.append(Row(f"mqar/hope_d{dim}", "configs/mqar.py:hope", (("model.dim", dim),)))
    return out


def table(runs: Runs) -> list[str]:
    entries = runs.rows("mqar/")
    splits = []
    for _, records in entries.values():
        for split in metrics.final_eval(records):
            if split not in splits:
                splits.append(split)
    lines = text.head(["rule", "dim", *splits, "mean", "steps", "wall", "command"])
    for row_id, (record, records) in entries.items():
        rule, dim = row_id.removeprefix("mqar/").rsplit("_d", 1)
        final = metrics.final_eval(records)
        failed = text.outcome(record, final)
        cells = [text.pct(final[s]["accuracy"]) if s in final else "—" for s in splits]
        mean = metrics.summary(records).get("mean_accuracy") if final else None
        steps = max((r["step"] for r in final.values()), default=0)
        if failed:
            cells = [failed] + [""] * (len(splits) - 1)
        steps_ = [text.pct(mean), str(steps), text.wall(record), text.cmd(record)]
        lines.append(text.row([rule, dim, *cells, *steps_]))
    return lines


def render(runs: Runs) -> str:
    notes = sorted(
        {f"`{r.id.split('/')[1].rsplit('_d', 1)[0]}`: {r.note}" for r in rows() if r.note}
    )
    parts = text.parts("mqar")
    overrides = text.fill(parts["overrides"], notes="; ".join(notes)) if notes else ""
    return text.fill(parts["section"], table=table(runs), overrides=overrides)


SECTIONS = (Section("mqar", text.title("mqar"), render),)
