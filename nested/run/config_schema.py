"""What an experiment config holds: its sections, the registries they name, their keys.

Registries map the names a config gives to code, so a new rule, model or task serves every
config: ``task.name`` -> :data:`nested.data.TASKS`, ``model.name`` -> :data:`MODELS`,
``levels.<name>.rule`` -> :func:`nested.recipes.named` or an import path (:func:`recipe`),
``optimizer.name`` -> :data:`OPTIMIZERS`. A section's other keys are the parameters of that
code (:mod:`nested.run.config_fields`): the model's include its *level slots*, which name
``levels`` entries; a level's, the :class:`nested.Level` fields its recipe passes on and
``owner`` (the level producing its context; default: the model); the optimizer's, its
:class:`Schedule`. ``train`` (:class:`Train`; ``train.mesh``:
:data:`nested.run.sharding.MESH_DEFAULTS`) and ``plasticity`` (:class:`Plasticity`) are
typed settings. The ``*_config`` helpers write a section with every key, so a locked config
takes an override of any and rejects a typo; :func:`main` lists them. The checks here are of
names; :func:`nested.run.config.build` checks the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import optax
from ml_collections import config_dict

from nested import data
from nested.levels import recipes
from nested.nn.frequencies import MultiFrequencyMemory
from nested.nn.hybrid import MemoryAsContext
from nested.nn.layers import MemoryLayer
from nested.nn.models import MemoryLM
from nested.plasticity.alignment import FORMS
from nested.run import config_fields as cf
from nested.run.sharding import MESH_DEFAULTS, RULE_DEFAULTS

SECTIONS = ("seed", "task", "model", "levels", "optimizer", "train", "plasticity")
OPTIONAL = ("plasticity",)  # a config (or a run's config.json) without it takes its defaults
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": optax.adamw,
    "adam": optax.adam,
    "sgd": optax.sgd,
}


class ConfigError(ValueError):
    """An invalid config; the message names the key and the allowed values."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The outer learning rate's schedule, keys of ``optimizer`` (``grad_clip=0``: none)."""

    schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class Train:
    """The ``train`` section: the training loop's settings."""

    steps: int = 1000  # outer steps (one batch each)
    batch_size: int = 32
    steps_per_call: int = 1  # outer steps per jitted call (a lax.scan over batches)
    log_every: int = 50
    eval_every: int = 200
    eval_batches: int = 4  # held-out batches per eval split
    eval_batch_size: int = 32
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    skip_nonfinite: bool = False  # a non-finite step keeps the previous state (else: stop)
    max_skipped_fraction: float = 0.1  # more skipped steps (of train.steps) stop the run
    smoke: bool = False  # a short check run of the config (nested.run.config.as_run)
    # The model's compute precision; parameters and fast states stay float32 (nested.compile).
    dtype: Literal["float32", "bfloat16"] = "float32"
    microbatches: int = 1  # each batch runs as microbatches, gradients averaged (accumulation)


@dataclasses.dataclass(frozen=True)
class Plasticity:
    """The ``plasticity`` section: the alignment of the fast levels' updates logged in
    training (:mod:`nested.plasticity.alignment`) on the batch's first ``rows`` rows."""

    every: int = 0  # steps between measurements; 0: never
    form: Literal[FORMS] = "through_scan"
    rows: int = 8


SETTINGS = {  # the sections of settings and their fields
    "train": cf.dataclass_fields(Train),
    "train.mesh": cf.plain(MESH_DEFAULTS),
    "train.mesh.rules": cf.plain(RULE_DEFAULTS),
    "plasticity": cf.dataclass_fields(Plasticity),
}


class ModelEntry(NamedTuple):
    """A model a config can name: ``build(**slots, vocab=..., rngs=..., **hyperparameters)``
    makes the ``nnx.Module``; ``widths(slot, hyperparameters)``: the ``(d_k, d_v)`` of a
    level in ``slot`` that leaves them unset; ``also``: callables receiving ``build``'s
    ``**kwargs`` (their keyword parameters are model keys too)."""

    build: Callable[..., Any]
    widths: Callable[[str, Mapping[str, Any]], tuple[int, int]]
    also: tuple[Callable[..., Any], ...] = ()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _memory_lm_widths(slot: str, hyper: Mapping[str, Any]) -> tuple[int, int]:
    dim, heads = hyper["dim"], hyper["heads"]
    if slot in ("cms", "projections"):  # a CMS block and Hope's projections map dim -> dim
        return dim, dim
    if not (isinstance(heads, int) and isinstance(dim, int) and heads >= 1 and dim >= 1):
        raise ConfigError(f"model.dim={dim!r} and model.heads={heads!r} must be ints >= 1")
    if dim % heads:
        raise ConfigError(
            f"model.dim={dim} is not divisible by model.heads={heads} (each head's memory is "
            f"dim/heads wide unless levels.*.d_k/d_v are set); allowed heads: {divisors(dim)}"
        )
    return dim // heads, dim // heads


MODELS = {
    "memory_lm": ModelEntry(
        MemoryLM, _memory_lm_widths, (MemoryLayer, MemoryAsContext, MultiFrequencyMemory)
    )
}


def lookup(key: str, name: Any, registry: Mapping[str, Any]):
    """``registry[name]``, or a :class:`ConfigError` naming ``key``."""
    if name not in registry:
        raise ConfigError(f"{key}={name!r} is unknown; allowed: {sorted(registry)}")
    return registry[name]


def wrapped(key: str | None, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, a ValueError or TypeError it raises a ConfigError naming
    ``key`` (None: the message names it)."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key}: {error}" if key else str(error)) from error


def recipe(key: str, rule: Any) -> Callable[..., Any]:
    """The level recipe ``rule`` names: a registered one, or the function at the import path
    ``"module:function"`` (installed, on ``PYTHONPATH`` or, for the entry points, in the
    current folder) of their signature, ``(name, *, d_k, d_v, **level_kwargs) -> Level``."""
    named = recipes.named()
    if rule in named:
        return named[rule]
    if not (isinstance(rule, str) and ":" in rule):
        raise ConfigError(
            f"{key}={rule!r} is unknown; allowed: {sorted(named)} or a recipe's import path, "
            "module:function"
        )
    module_name, _, name = rule.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError(
            f"{key}={rule!r}: no module named {error.name!r}; install it, add its folder to "
            "PYTHONPATH or run from the folder that holds it"
        ) from error
    except Exception as error:  # noqa: BLE001 - an error inside the user's module
        raise ConfigError(
            f"{key}={rule!r}: importing {module_name} failed: {type(error).__name__}: {error}"
        ) from error
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
        raise ConfigError(
            f"{key}={rule!r}: module {module_name} has no function {name!r}; allowed: {functions}"
        )
    return fn


def task_fields(name: str) -> cf.Fields:
    return cf.task_fields(name, lookup("task.name", name, data.TASKS))


def model_fields(name: str) -> cf.Fields:
    """A model's keys; those a rule sets in its layer (:data:`nested.recipes.LAYER_OPTIONS`)
    default to None, "as the slot's rule needs"."""
    entry = lookup("model.name", name, MODELS)
    unset = {key for options in recipes.LAYER_OPTIONS.values() for key in options}
    return cf.model_fields(name, entry.build, entry.also, unset=unset)


def level_fields(rule: str, key: str = "levels.*.rule") -> cf.Fields:
    return cf.level_fields(rule, recipe(key, rule))


def optimizer_fields(name: str) -> cf.Fields:
    fn = lookup("optimizer.name", name, OPTIMIZERS)
    fields = {"name": cf.Field(name, str), "learning_rate": cf.Field(None, float)}
    return fields | cf.dataclass_fields(Schedule) | cf.configurable(fn, ("learning_rate",))


def check_keys(key: str, section: Any, allowed: Iterable[str]) -> dict[str, Any]:
    """The values of the section ``key``, or a :class:`ConfigError` for a key not allowed."""
    if not isinstance(section, Mapping | config_dict.ConfigDict):
        raise ConfigError(f"{key} must be a ConfigDict section, got {section!r}")
    unknown = sorted(set(section.keys()) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a key of {key}; allowed: {sorted(allowed)}")
    return dict(section.items())


def check_required(key: str, values: Mapping[str, Any], fields: cf.Fields) -> None:
    """A :class:`ConfigError` for a key without a default that ``values`` leaves unset."""
    for name, field in fields.items():
        if field.default is cf.REQUIRED and values.get(name) is None:
            raise ConfigError(f"{key}.{name} is required; set it in the config")


def check_sections(config: config_dict.ConfigDict) -> None:
    """A :class:`ConfigError` unless ``config`` has the :data:`SECTIONS` (or all but the
    :data:`OPTIONAL` ones) and no other."""
    unknown = sorted(set(config.keys()) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config.{unknown[0]} is not a section; allowed: {list(SECTIONS)}")
    missing = [s for s in SECTIONS if s not in config and s not in OPTIONAL]
    if missing:
        raise ConfigError(f"config.{missing[0]} is missing; a config has {list(SECTIONS)}")


def slots(config, model: Mapping[str, Any], entry: ModelEntry) -> tuple[dict, dict]:
    """Each model slot's level name(s), and each declared level's slot. A
    :class:`ConfigError` for a slot naming an undeclared level, a level in no slot, and a
    ``model.level`` that does not go with ``model.mixer`` (``"attention"``, MemoryLM's
    Transformer++, takes none and may declare no levels; every other mixer needs one)."""
    attention, declared = model.get("mixer") == "attention", list(config.get("levels", {}))
    if not attention and not declared:
        raise ConfigError(
            "levels: declare at least one fast level (levels.<name>.rule=...), or set "
            "model.mixer='attention' for a model without one"
        )
    if attention and model.get("level") is not None:
        raise ConfigError(
            f"model.level={model['level']!r}: model.mixer='attention' runs no fast level; "
            "unset model.level (and its levels entry) or choose a memory mixer"
        )
    if not attention and model.get("level") is None:
        raise ConfigError(
            f"model.level is required with model.mixer={model.get('mixer')!r}; set it to a "
            f"declared level, one of {sorted(declared)}"
        )
    many_of = cf.model_slots(entry.build, entry.also)
    names_in, slot_of = {slot: model.get(slot) for slot in many_of}, {}
    for slot, names in names_in.items():
        for name in (names or ()) if many_of[slot] else [names] if names is not None else []:
            if name not in declared:
                raise ConfigError(
                    f"model.{slot}={name!r} is not a declared level; allowed: {sorted(declared)}"
                )
            slot_of[name] = slot
    unused = [name for name in declared if name not in slot_of]
    if unused:
        raise ConfigError(
            f"levels.{unused[0]} is declared but no model slot uses it; set one of "
            f"{[f'model.{s}' for s in names_in]} to {unused[0]!r}"
        )
    return names_in, slot_of


def owners(config, outer: str) -> dict[str, str]:
    """Each level's owner (``levels.<name>.owner``, default ``outer``), or a
    :class:`ConfigError` for one that is neither ``outer`` nor another level."""
    names = list(config.levels.keys())
    out = {name: config.levels[name].get("owner") or outer for name in names}
    for name, owner in out.items():
        if owner not in (outer, *names) or owner == name:
            allowed = [outer, *(n for n in names if n != name)]
            raise ConfigError(f"levels.{name}.owner={owner!r} is unknown; allowed: {allowed}")
    return out


def variant(arg: str | None, *, default: str = "delta", others: Sequence[str] = ()) -> str:
    """The variant a config file was given (``configs/x.py:<variant>``): ``arg``, or
    ``default``; a memory rule of :data:`nested.recipes.RULES` or one of ``others``."""
    name, allowed = arg or default, sorted({*recipes.RULES, *others})
    if name not in allowed:
        raise ConfigError(f"variant {name!r} is unknown; allowed variants: {allowed}")
    return name


def _section(fields: cf.Fields, values: Mapping[str, Any]) -> config_dict.ConfigDict:
    return wrapped(None, cf.section, fields, values)


def task_config(name: str, **fields) -> config_dict.ConfigDict:
    """The ``task`` section: ``name`` and every field of the task, ``fields`` overriding."""
    return _section(task_fields(name), {"name": name, **fields})


def model_config(name: str, **hyper) -> config_dict.ConfigDict:
    """The ``model`` section: ``name``, the model's hyperparameters and level slots."""
    return _section(model_fields(name), {"name": name, **hyper})


def level_config(rule: str, **fields) -> config_dict.ConfigDict:
    """A ``levels`` entry: ``rule``, ``owner``, the recipe's hyperparameters and the
    :class:`nested.Level` fields it passes on (``every``, ``persist``, ``chunk``, ...)."""
    return _section(level_fields(rule), {"rule": rule, **fields})


def optimizer_config(name: str = "adamw", **hyper) -> config_dict.ConfigDict:
    """The ``optimizer`` section: ``name``, ``learning_rate``, the :class:`Schedule` and the
    optax function's simple hyperparameters."""
    return _section(optimizer_fields(name), {"name": name, **hyper})


def train_config(*, mesh: Mapping[str, Any] | None = None, **fields) -> config_dict.ConfigDict:
    """The ``train`` section: :class:`Train` overridden by ``fields``, and its ``mesh`` (of
    :data:`~nested.run.sharding.MESH_DEFAULTS`, ``rules`` of
    :data:`~nested.run.partitioning.RULE_DEFAULTS`) by ``mesh``."""
    mesh = dict(mesh or {})
    rules = _section(SETTINGS["train.mesh.rules"], mesh.pop("rules", {}))
    section = _section(SETTINGS["train"], fields)
    section.mesh = _section(SETTINGS["train.mesh"], mesh)
    section.mesh.rules = rules
    return section


def plasticity_config(**fields) -> config_dict.ConfigDict:
    """The ``plasticity`` section: :class:`Plasticity` overridden by ``fields``."""
    return _section(SETTINGS["plasticity"], fields)


def load(spec: str) -> config_dict.ConfigDict:
    """``get_config(variant)`` of the file ``spec = "path.py[:variant]"``, unlocked: the
    entry points' ``--config path.py:variant`` from Python (notebooks, tests)."""
    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or not Path(path).is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def _tuples(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _node(config: config_dict.ConfigDict, prefix: str) -> Any:
    for part in prefix.split("."):
        config = config.get(part, {}) if isinstance(config, config_dict.ConfigDict) else {}
    return config


def from_json(data: Mapping[str, Any]) -> config_dict.ConfigDict:
    """A config read back from its JSON (a run's ``config.json``) as its file made it: lists
    as tuples, each None a placeholder of its key's type (so ``--config.<key>=...`` parses as
    on the file's config). A :class:`ConfigError` for a name no registry knows."""
    config = config_dict.ConfigDict(_tuples(data))
    for prefix, fields in accepted(config).items():
        node = _node(config, prefix)
        for key, value in node.items():
            if value is None and key in fields and fields[key].type is not None:
                node[key] = config_dict.placeholder(fields[key].type)
    return config


def accepted(config: config_dict.ConfigDict) -> dict[str, cf.Fields]:
    """The keys each section of ``config`` accepts (``levels.<name>`` for each level), with
    their values in ``config`` as defaults."""
    sections = {
        "task": task_fields(config.task.name),
        "model": model_fields(config.model.name),
        **{
            f"levels.{n}": level_fields(s.rule, f"levels.{n}.rule")
            for n, s in config.levels.items()
        },
        "optimizer": optimizer_fields(config.optimizer.name),
        **SETTINGS,
    }
    out = {}
    for prefix, fields in sections.items():
        node = _node(config, prefix)
        out[prefix] = {k: f._replace(default=node.get(k, f.default)) for k, f in fields.items()}
    return out


def registered() -> dict[str, cf.Fields]:
    """The keys of every registered level recipe, model, task and optimizer, and of the
    settings (``tests/docs/config_keys.txt`` is their :func:`~nested.run.config_fields.listing`)."""
    return {
        **{f"levels[rule={rule}]": level_fields(rule) for rule in sorted(recipes.named())},
        **{f"model[name={name}]": model_fields(name) for name in sorted(MODELS)},
        **{f"task[name={name}]": task_fields(name) for name in sorted(data.TASKS)},
        **{f"optimizer[name={name}]": optimizer_fields(name) for name in sorted(OPTIMIZERS)},
        **SETTINGS,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m nested.run.config CONFIG.py[:variant]`` prints every key the config's
    sections accept, ``section.key  type  value``; ``--registered``, those of every registered
    rule and level recipe, model, task and optimizer, ``section[rule=...].key  type  default``."""
    parser = argparse.ArgumentParser(prog="python -m nested.run.config", description=main.__doc__)
    parser.add_argument("config", nargs="?", help="a config file, path.py[:variant]")
    parser.add_argument("--registered", action="store_true", help="every registered name's keys")
    args = parser.parse_args(argv)
    if (args.config is None) != args.registered:
        parser.error("give a config file or --registered")
    try:
        sections = registered() if args.registered else accepted(load(args.config))
    except ConfigError as error:
        sys.exit(f"error: {error}")
    sys.stdout.write(cf.listing(sections))
