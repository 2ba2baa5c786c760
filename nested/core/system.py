"""``NestedSystem``: an ordered set of levels and who owns whom.

A nested system (Nested Learning, Definitions 3-4) is a set of levels ordered by update
frequency. Each fast level is *owned* by a slower level, which produces its context (keys,
values, queries, gates) and meta-learns its initial state; the outermost level
(``every="step"``) is updated once per training step and owns, directly or through other
levels, every fast level.

Validation happens at construction, before anything is traced, and raises ``ValueError``
naming the level and the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nested.core.level import Level


class NestedSystem:
    """Levels plus the ``owners`` map ``{fast level name: owner level name}``.

    ``levels`` come out ordered fastest first (by ``every``, the outermost last).
    """

    def __init__(self, levels: Sequence[Level], owners: Mapping[str, str] | None = None):
        owners = dict(owners or {})
        for i, level in enumerate(levels):
            if not isinstance(level, Level):
                raise ValueError(f"levels[{i}] is a {type(level).__name__}, not a nested.Level")
        names = [level.name for level in levels]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"level name {name!r} is used by {names.count(name)} levels")
        by_name = {level.name: level for level in levels}
        outer = [level.name for level in levels if level.is_outer]
        if len(outer) != 1:
            raise ValueError(
                f"a nested system needs exactly one outermost level (every='step'), got {outer}"
            )
        for fast, owner in owners.items():
            if fast not in by_name:
                raise ValueError(f"owners: {fast!r} is not a level of the system {names}")
            if owner not in by_name:
                raise ValueError(f"owners[{fast!r}]: owner {owner!r} is not a level of {names}")
            if by_name[fast].is_outer:
                raise ValueError(f"owners[{fast!r}]: the outermost level has no owner")
        for level in levels:
            if level.is_outer:
                continue
            if level.name not in owners:
                raise ValueError(
                    f"level {level.name!r} has no owner: add owners={{{level.name!r}: ...}} "
                    f"naming the slower level that produces its context"
                )
            self._check_chain(level.name, owners, by_name)
            if level.learns_outer_loss and level.gates:
                raise ValueError(
                    f"level {level.name!r}: a level learning from the outer loss over its period "
                    f"gets no per-token gates; its update must use constants, not "
                    f"{sorted(level.gates)}"
                )
            owner = by_name[owners[level.name]]
            if not owner.is_outer and owner.every % level.every != 0:
                raise ValueError(
                    f"level {level.name!r}: every={level.every} does not divide the period "
                    f"every={owner.every} of its owner {owner.name!r}"
                )
        periods = sorted({level.every for level in levels if not level.is_outer})
        for fast, slow in zip(periods, periods[1:], strict=False):
            if slow % fast:
                slowest = [level.name for level in levels if level.every == slow]
                raise ValueError(
                    f"level {slowest[0]!r}: every={slow} is not a multiple of the faster period "
                    f"{fast}; the periods of a nested system must divide one another"
                )
        outer = [level for level in levels if level.learns_outer_loss]
        if outer:
            shortest = min(outer, key=lambda level: level.every)
            for level in levels:
                if not (level.is_outer or level in outer) and shortest.every % level.every:
                    raise ValueError(
                        f"level {level.name!r}: every={level.every} does not divide the period "
                        f"every={shortest.every} of {shortest.name!r}, in which the model runs"
                    )
        self.levels: tuple[Level, ...] = tuple(
            sorted(levels, key=lambda level: float("inf") if level.is_outer else level.every)
        )
        self.owners: dict[str, str] = owners

    @staticmethod
    def _check_chain(name: str, owners: Mapping[str, str], by_name: Mapping[str, Level]):
        seen = [name]
        while not by_name[seen[-1]].is_outer:
            nxt = owners.get(seen[-1])
            if nxt is None:
                raise ValueError(f"level {seen[-1]!r} has no owner")
            if nxt in seen:
                raise ValueError(f"owners form a cycle: {' -> '.join([*seen, nxt])}")
            seen.append(nxt)

    @property
    def outer(self) -> Level:
        return self.levels[-1]

    @property
    def fast_levels(self) -> tuple[Level, ...]:
        return self.levels[:-1]

    def __getitem__(self, name: str) -> Level:
        for level in self.levels:
            if level.name == name:
                return level
        raise KeyError(f"no level {name!r}; levels are {[level.name for level in self.levels]}")

    def __repr__(self) -> str:
        body = ", ".join(f"{level.name}(every={level.every})" for level in self.levels)
        return f"NestedSystem([{body}], owners={self.owners})"
