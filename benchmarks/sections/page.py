"""The results page: its introduction, the hand-written observations kept from the previous
page, then every section in page order (:data:`PAGE`); and the rows of all sections in the
order they run (:func:`rows`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import report

from sections import (
    char_lm,
    companion,
    continual,
    frequencies,
    lm,
    mqar,
    mqar_zoology,
    niah,
    plasticity,
    ruler,
    text,
)
from sections.rows import Row, Runs, Section

PAGE = (mqar, mqar_zoology, char_lm, niah, continual, plasticity, frequencies, companion, lm, ruler)
SECTIONS: dict[str, Section] = {s.name: s for module in PAGE for s in module.SECTIONS}
_OBSERVATIONS = re.compile(r"^## Observations\n.*?(?=^## |\Z)", re.M | re.S)


def rows(widths: Sequence[int]) -> list[Row]:
    """Every row, MQAR's at ``widths``; the companion's run before the multi-frequency
    streams' (the order the table was first run in)."""
    later = (char_lm, niah, continual, plasticity, companion, frequencies, lm, mqar_zoology)
    return [*mqar.rows(widths), *(row for module in later for row in module.rows())]


def render(runs: Runs, previous: str = "") -> str:
    """The whole page; ``previous``: the page it replaces, whose ``## Observations`` section
    (hand-written) goes after the introduction."""
    kept = _OBSERVATIONS.search(previous)
    intro = text.fill(
        text.parts("page")["intro"],
        machine=report.machine(),
        date=report.utc_now(),
        observations=kept.group(0).strip() if kept else "",
    )
    sections = (s.render(runs) for module in PAGE for s in module.SECTIONS)
    return "\n".join([intro, *(s for s in sections if s)])


def replace(page: str, runs: Runs, names: Sequence[str]) -> str:
    """``page`` with the sections ``names`` rendered again (appended where it has none)."""
    for name in names:
        section = SECTIONS[name].render(runs).strip() + "\n\n"
        title = re.escape(SECTIONS[name].title)
        pattern = re.compile(rf"^## {title}\n.*?(?=^## |\Z)", re.M | re.S)
        if pattern.search(page):
            page = pattern.sub(lambda _: section, page)
        else:
            page = page.rstrip() + "\n\n" + section
    return page.rstrip() + "\n"
