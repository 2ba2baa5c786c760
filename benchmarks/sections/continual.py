"""The "Continual key-value stream" section: per task of ``configs/continual.py``, accuracy on
all queries, in context and from memory at the end of training, and forgetting."""

from __future__ import annotations

import json

from nested.run import metrics
from sections import text
from sections.rows import Row, Runs, Section


def rows() -> list[Row]:
    return [Row("continual/delta", "configs/continual.py:delta")]


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


def table(runs: Runs) -> list[str]:
    """The table's lines, a blank line, and the rows' commands."""
    head = ["rule", "task", "accuracy", "in-context", "from memory"]
    head += ["from memory at the end of its phase", "forgetting"]
    lines, commands = text.head(head), []
    for row_id, (record, records) in runs.rows("continual/").items():
        rule = row_id.removeprefix("continual/")
        final = metrics.final_eval(records)
        failed = text.outcome(record, final)
        commands.append(f"* {rule} ({text.wall(record)}): {text.cmd(record)}")
        if failed:
            lines.append(text.failed_row(rule, failed, len(head)))
            continue
        config = json.loads((runs.workdir / row_id / "config.json").read_text())
        switch = config["task"]["switch_every"]
        drops, mean = forgetting(records, switch)
        for split, r in final.items():
            end = (int(split.removeprefix("task")) + 1) * switch
            at_end = [x for x in records if x["split"] == split and x["step"] == end]
            cells = [r["accuracy"], r.get("in_context_accuracy"), r.get("memory_accuracy")]
            cells += [at_end[0].get("memory_accuracy") if at_end else None, drops.get(split)]
            name = f"{split} (steps {end - switch}-{end})"
            lines.append(text.row([rule, name, *map(text.pct, cells)]))
        lines.append(f"| {rule} | mean forgetting | | | | | {text.pct(mean)} |")
    return lines + [""] + commands


def render(runs: Runs) -> str:
    return text.fill(text.parts("continual")["section"], table=table(runs))


SECTIONS = (Section("continual", text.title("continual"), render),)
