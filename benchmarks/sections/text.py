"""The markdown of the sections: their prose templates and the cells of their tables.

A section's prose lives in ``sections/<module>.md``, split into named parts by lines
``<!-- NAME -->``; each part is a :class:`string.Template` (``$field`` placeholders for tables,
figures and numbers; ``$$`` a dollar). :func:`fill` substitutes a part and joins its blocks:
a placeholder left empty leaves no blank lines behind.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

_PART = re.compile(r"^<!-- (\w+) -->\n", re.M)


@functools.cache
def parts(module: str) -> dict[str, string.Template]:
    """The named parts of ``sections/<module>.md`` (newlines around each part stripped)."""
    text = (Path(__file__).with_name(module + ".md")).read_text()
    _, *pairs = _PART.split(text)
    names, bodies = pairs[0::2], pairs[1::2]
    return {n: string.Template(b.strip("\n")) for n, b in zip(names, bodies, strict=True)}


def title(module: str, part: str = "section") -> str:
    """The heading of a section's template part (its first line, ``## TITLE``)."""
    return parts(module)[part].template.split("\n", 1)[0].removeprefix("## ")


def fill(template: string.Template, **fields: object) -> str:
    """``template`` with its ``fields`` substituted, runs of blank lines made one (an empty
    field's line disappears) and one newline at the end."""
    text = template.substitute(
        {k: "\n".join(v) if isinstance(v, list) else v for k, v in fields.items()}
    )
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def head(names: Sequence[str]) -> list[str]:
    """A table's header and separator lines."""
    return [row(names), "|" + "---|" * len(names)]


def row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def failed_row(name: str, failed: str, width: int) -> str:
    """A table line of ``width`` columns: the row's name and why it has no results."""
    return f"| {name} | {failed} |" + " |" * (width - 2)


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def wall(record: dict) -> str:
    return f"{record['wall_s']:.0f} s"


def cmd(record: dict) -> str:
    return f"`{record['command']}`"


def commands(record: dict) -> str:
    """The training command and its ``after`` command."""
    measured = record.get("after", {})
    return f"`{record['command']}`; `{measured.get('command', '')}`"


def outcome(record: dict, final: dict) -> str | None:
    """None if the training run has final evaluations to show, else why not."""
    if record["status"] == 0 and final:
        return None
    return f"**failed**: {record['error'] or 'no evaluation'}"


def failed(record: dict, result: dict | None, name: str) -> str | None:
    """None if the row's measurement ``result`` (the file ``name``) exists, else why not: the
    ``after`` script's error, the training's, or the missing file."""
    if result is not None:
        return None
    measured = record.get("after") or {}
    return f"**failed**: {measured.get('error') or record['error'] or 'no ' + name}"
