"""The keys a config section accepts, read off the signatures of the code the section names.

A section's *fields* are ``{key: Field(default, type)}``, the type a ConfigDict type of
:data:`CONFIG_TYPES`: a callable's keyword parameters of such a type (:func:`configurable`;
one annotated ``Level`` is a *level slot*, a ``str`` naming a level, ``Sequence[Level]`` a
``tuple`` of names), the :data:`LEVEL_FIELDS` a recipe's ``**level_kwargs`` pass on, or a
dataclass's fields (a task, the ``train`` settings). :func:`section` writes them into a
ConfigDict of every key, typed, so a locked config takes an override of any key and rejects
any other; :func:`listing` prints them.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ml_collections import config_dict

from nested.core.level import Level

REQUIRED = inspect.Parameter.empty  # the default of a key without one
CONFIG_TYPES = (int, float, str, bool, tuple)
# Level fields a recipe passes on through **level_kwargs (it fixes the others): config types.
LEVEL_FIELDS = types.MappingProxyType(
    {"every": int, "persist": str, "read": str, "truncate": int, "first_order": bool}
    | {"chunk": int, "accumulate": int}
)
WIDTHS = ("d_k", "d_v")  # a level recipe's memory widths: ints, annotated or not


class Field(NamedTuple):
    """A key: its default (:data:`REQUIRED` if none), its config type (None: unknown)."""

    default: Any
    type: type | None


Fields = dict[str, Field]


def value_type(hint: Any) -> type | None:
    """The config type of a parameter annotated ``hint``, None if not configurable:
    ``int | None`` is an int, ``Literal["a", "b"]`` a str, a sequence a tuple."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = {value_type(a) for a in args if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if origin is typing.Literal:
        return type(args[0])
    if origin in (tuple, Sequence) or hint is tuple:
        return tuple
    return hint if hint in (int, float, str, bool) else None


def slot_kind(hint: Any) -> type | None:
    """A level slot's config type: ``str`` for ``Level`` or ``Level | None``, ``tuple`` for
    ``Sequence[Level]``; None if ``hint`` is not a slot."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if hint is Level or (union and set(typing.get_args(hint)) == {Level, type(None)}):
        return str
    several = typing.get_origin(hint) is Sequence and typing.get_args(hint) == (Level,)
    return tuple if several else None


def parameters(fn: Callable) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """The named parameters of ``fn`` (a class: its ``__init__``), their type hints, and
    whether it takes ``**kwargs``."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = dict(inspect.signature(target).parameters)
    params.pop("self", None)
    try:
        hints = typing.get_type_hints(target)
    except NameError:  # unresolvable annotations: fall back to the defaults' types
        hints = {}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named, hints, var_kw


def configurable(fn: Callable, skip: Iterable[str] = ()) -> Fields:
    """The parameters of ``fn`` but ``skip`` a config can set: of a config type (annotated,
    or unannotated with a default of one), or a level slot."""
    named, hints, _ = parameters(fn)
    fields = {}
    for name, p in named.items():
        kind = slot_kind(hints.get(name)) or value_type(hints.get(name))
        if kind is None and p.default is not REQUIRED and p.default is not None:
            kind = type(p.default)
        if name not in skip and kind in CONFIG_TYPES:
            fields[name] = Field(p.default, kind)
    return fields


def plain(defaults: Mapping[str, Any]) -> Fields:
    """The fields of a mapping of defaults, each of its default's type."""
    return {key: Field(value, type(value)) for key, value in defaults.items()}


def dataclass_fields(cls: type) -> Fields:
    """The fields of the dataclass ``cls``, typed by their annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: Field(f.default, value_type(hints[f.name])) for f in dataclasses.fields(cls)}


def level_fields(rule: str, recipe: Callable[..., Level]) -> Fields:
    """A ``levels`` entry of ``rule``: ``rule``, ``owner`` (the level producing its context;
    None: the model), the keyword parameters of ``recipe`` but ``name`` (its :data:`WIDTHS`
    ints even unannotated), and the :data:`LEVEL_FIELDS` its ``**kwargs`` (if any) pass on."""
    fields = {"rule": Field(rule, str), "owner": Field(None, str)}
    named, _, var_kw = parameters(recipe)
    fields |= {k: Field(named[k].default, int) for k in WIDTHS if k in named}
    fields |= configurable(recipe, skip=("name",))
    for f in dataclasses.fields(Level) if var_kw else ():
        if f.name in LEVEL_FIELDS and f.name not in fields:
            fields[f.name] = Field(f.default, LEVEL_FIELDS[f.name])
    return fields


def task_fields(name: str, cls: type) -> Fields:
    """The ``task`` section of the task dataclass ``cls`` named ``name``."""
    return {"name": Field(name, str), **dataclass_fields(cls)}


def _signatures(build: Callable, also: Sequence[Callable]) -> list[tuple[Callable, set]]:
    """``(callable, names to skip)`` pairs whose keyword parameters are a model's keys."""
    own = set(parameters(build)[0])
    return [(build, {"vocab", "rngs"})] + [(fn, own | {"rngs"}) for fn in also]


def model_fields(
    name: str, build: Callable, also: Sequence[Callable] = (), *, unset: Iterable[str] = ()
) -> Fields:
    """The ``model`` section of the model ``build`` named ``name``: ``name``, the parameters
    of ``build`` but ``vocab`` and ``rngs``, then those it lacks of the ``also`` callables
    (which receive its ``**kwargs``); the keys of ``unset`` default to None."""
    fields = {"name": Field(name, str)}
    for fn, skip in _signatures(build, also):
        for key, field in configurable(fn, skip).items():
            fields.setdefault(key, field._replace(default=None) if key in unset else field)
    return fields


def model_slots(build: Callable, also: Sequence[Callable] = ()) -> dict[str, bool]:
    """The level slots of a model's section: ``{key: whether it takes several levels}``."""
    slots = {}
    for fn, skip in _signatures(build, also):
        named, hints, _ = parameters(fn)
        for name in named:
            if name not in skip and (kind := slot_kind(hints.get(name))):
                slots.setdefault(name, kind is tuple)
    return slots


def section(fields: Mapping[str, Field], values: Mapping[str, Any]) -> config_dict.ConfigDict:
    """A ConfigDict of every key of ``fields``, typed: its default (lists as tuples; None or
    none: a placeholder of its type, which a locked config lets an override of that type set)
    replaced by its value in ``values``. A ``ValueError`` for a key ``fields`` lacks, a
    ``TypeError`` (ml_collections') for a value of another type."""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(fields)}")
    out = config_dict.ConfigDict()
    for name, (default, kind) in fields.items():
        default = tuple(default) if isinstance(default, list) else default
        unset = default is None or default is REQUIRED
        out[name] = config_dict.placeholder(kind) if unset else default
        if name in values:  # typed: ConfigDict's own check raises a TypeError naming the key
            out[name] = values[name]
    return out


def listing(sections: Mapping[str, Mapping[str, Field]]) -> str:
    """``section.key  type  default`` lines (``required``: no default) of ``{section:
    fields}``, sorted in each section."""
    lines = []
    for prefix, fields in sections.items():
        for key, (default, kind) in sorted(fields.items()):
            value = "required" if default is REQUIRED else repr(default)
            lines.append(
                f"{prefix + '.' + key:<40}  {kind.__name__ if kind else 'any':<5}  {value}"
            )
    return "\n".join(lines) + "\n"
