"""The "Needle in a haystack" section: accuracy by context length of ``configs/niah.py``."""

from __future__ import annotations

from nested.run import metrics
from sections import text
from sections.rows import Row, Runs, Section


def rows() -> list[Row]:
    return [Row("niah/delta", "configs/niah.py:delta")]


def table(runs: Runs) -> list[str]:
    lines = []
    for row_id, (record, records) in runs.rows("niah/").items():
        final = metrics.final_eval(records)
        splits = list(final)
        if not lines:
            lines = text.head(
                ["rule", *(f"accuracy {s}" for s in splits), "steps", "wall", "command"]
            )
        failed = text.outcome(record, final)
        cells = [failed] if failed else [text.pct(final[s]["accuracy"]) for s in splits]
        steps = max((r["step"] for r in final.values()), default=0)
        rule = row_id.removeprefix("niah/")
        lines.append(text.row([rule, *cells, str(steps), text.wall(record), text.cmd(record)]))
    return lines


def render(runs: Runs) -> str:
    return text.fill(text.parts("niah")["section"], table=table(runs))


SECTIONS = (Section("niah", text.title("niah"), render),)
