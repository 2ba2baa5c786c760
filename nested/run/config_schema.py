"""What an experiment config holds: its sections, the registries they name, the keys of each.

A config names everything it uses and registries map the names to code, so a new rule, model
or task is available to every config without editing one:

* ``task.name`` -> :data:`nested.data.TASKS`; the other ``task`` keys are the task's fields;
* ``model.name`` -> :data:`MODELS`; the other ``model`` keys are the model's hyperparameters
  and its *level slots*, which hold names of ``levels`` entries (``MemoryLM``: ``level``, the
  mixer's level; ``projections``, that of the self-modifying mixer; ``cms``, a tuple);
* ``levels.<name>.rule`` -> :func:`nested.recipes.named` (the memory rules, ``cms`` blocks,
  Hope's ``projections``), or a recipe's import path ``module:function`` (:func:`recipe`),
  looked up when the config is built; the other keys are the
  recipe's hyperparameters, the :class:`nested.Level` fields it passes on (``every``,
  ``persist``, ``chunk``, ...) and ``owner`` (the slower level producing its context: the
  model, the default, or another level, as Hope's memory is owned by its ``projections``);
* ``optimizer.name`` -> :data:`OPTIMIZERS`, the outermost level's update rule, with its
  learning-rate schedule (:data:`SCHEDULE_DEFAULTS`);
* ``train``: the loop's settings (:data:`TRAIN_DEFAULTS`) and ``train.mesh``, how the run is
  spread over the devices (:data:`nested.run.sharding.MESH_DEFAULTS`).

The keys of a section are read off the signatures of the code it names
(:mod:`nested.run.config_fields`). The ``*_config`` helpers write a section with every key,
so any key can be overridden from the command line under ``lock_config=True``, which rejects
unknown keys; :func:`main` prints them (``python -m nested.run.config``). The checks here are
of names (sections, keys, registry names, the levels that model slots and owners name);
:func:`nested.run.config.build` checks the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optax
from ml_collections import config_dict

from nested import data
from nested.levels import recipes
from nested.nn.frequencies import MultiFrequencyMemory
from nested.nn.hybrid import MemoryAsContext
from nested.nn.layers import MemoryLayer
from nested.nn.models import MemoryLM
from nested.run import config_fields as cf
from nested.run.sharding import MESH_DEFAULTS, RULE_DEFAULTS

SECTIONS = ("seed", "task", "model", "levels", "optimizer", "train", "plasticity")
OPTIONAL = ("plasticity",)  # a config (or a run's config.json) without it takes its defaults
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": optax.adamw,
    "adam": optax.adam,
    "sgd": optax.sgd,
}
SCHEDULES = ("constant", "cosine")
SCHEDULE_DEFAULTS = types.MappingProxyType(
    {"schedule": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1, "grad_clip": 1.0}
)
DTYPES = ("float32", "bfloat16")  # train.dtype
TRAIN_DEFAULTS = types.MappingProxyType(
    {
        "steps": 1000,  # outer steps (one batch each)
        "batch_size": 32,
        "steps_per_call": 1,  # outer steps per jitted call (a lax.scan over batches)
        "log_every": 50,
        "eval_every": 200,
        "eval_batches": 4,  # held-out batches per eval split
        "eval_batch_size": 32,
        "checkpoint_every": 200,
        "keep_checkpoints": 3,
        "skip_nonfinite": False,  # a non-finite step keeps the previous state (else: stop)
        # More skipped steps than this fraction of train.steps stop the run (not trained).
        "max_skipped_fraction": 0.1,
        "smoke": False,  # a short check run of the config (nested.run.config.as_run)
        # The model's compute precision; parameters and fast states stay float32
        # (nested.compile's compute_dtype). One of DTYPES.
        "dtype": "float32",
        # Gradient accumulation: each batch runs as this many microbatches (rows split
        # evenly) inside one jitted step, their gradients averaged (nested.compile).
        "microbatches": 1,
    }
)


# Functional-plasticity figures logged during training (nested.plasticity.alignment).
PLASTICITY_DEFAULTS = types.MappingProxyType(
    {
        "every": 0,  # log the alignment of the fast levels' updates every N steps; 0: never
        "form": "through_scan",  # or "one_step" (nested.plasticity.alignment.FORMS)
        "rows": 8,  # the batch rows it is measured on (the first ones): its cost grows with them
    }
)


class ConfigError(ValueError):
    """An invalid config; the message names the key and the allowed values."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """A model a config can name.

    ``build(**slots, vocab=..., rngs=..., **hyperparameters)`` makes the ``nnx.Module``; its
    arguments annotated ``Level`` or ``Sequence[Level]`` are *slots* filled with levels.
    ``also``: callables that receive ``build``'s ``**kwargs``; their keyword parameters are
    model keys too. ``widths(slot, hyperparameters)`` gives the ``(d_k, d_v)`` of a level in
    ``slot`` whose config leaves them unset, or raises :class:`ConfigError`.
    """

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


MODELS: dict[str, ModelEntry] = {
    "memory_lm": ModelEntry(
        MemoryLM, _memory_lm_widths, also=(MemoryLayer, MemoryAsContext, MultiFrequencyMemory)
    ),
}


def lookup(key: str, name: Any, registry: Mapping[str, Any]):
    """``registry[name]``; raises :class:`ConfigError` naming ``key`` if it is unknown."""
    if name not in registry:
        raise ConfigError(f"{key}={name!r} is unknown; allowed: {sorted(registry)}")
    return registry[name]


def wrapped(key: str | None, fn: Callable, *args, **kwargs):
    """Call ``fn``; a ValueError/TypeError it raises becomes a ConfigError naming ``key``
    (None: the message names it already)."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key}: {error}" if key else str(error)) from error


# -- the keys of each section ---------------------------------------------------------------


def task_fields(name: str) -> cf.Fields:
    return cf.task_fields(name, lookup("task.name", name, data.TASKS))


def model_fields(name: str) -> cf.Fields:
    """A model's keys; those a rule sets in its layer (:data:`nested.recipes.LAYER_OPTIONS`:
    Falcon's key shift) default to None, meaning "as the slot's rule needs"."""
    entry = lookup("model.name", name, MODELS)
    unset = {key for options in recipes.LAYER_OPTIONS.values() for key in options}
    return cf.model_fields(name, entry.build, entry.also, unset=unset)


def recipe(key: str, rule: Any) -> Callable[..., Any]:
    """The level recipe ``rule`` names: a registered one (:func:`nested.recipes.named`) or
    the function at the import path ``"module:function"``, a recipe of the registered ones'
    signature, ``(name, *, d_k, d_v, **level_kwargs) -> nested.Level``. The module must be
    importable (installed, on ``PYTHONPATH``, or, for the entry points, in the current
    folder). Raises :class:`ConfigError` naming ``key`` for an unknown name, a module that
    does not import or an attribute that is not a function."""
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


def level_fields(rule: str, key: str = "levels.*.rule") -> cf.Fields:
    return cf.level_fields(rule, recipe(key, rule))


def optimizer_fields(name: str) -> cf.Fields:
    fn = lookup("optimizer.name", name, OPTIMIZERS)
    fields = {"name": cf.Field(name, str), "learning_rate": cf.Field(None, float)}
    return {**fields, **cf.plain(SCHEDULE_DEFAULTS), **cf.configurable(fn, ("learning_rate",))}


# -- checking names ----------------------------------------------------------------------------


def check_keys(key: str, section: Any, allowed: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the section ``key``; raises :class:`ConfigError` for a key not in
    ``allowed``."""
    if not isinstance(section, Mapping | config_dict.ConfigDict):
        raise ConfigError(f"{key} must be a ConfigDict section, got {section!r}")
    values = dict(section.items())
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a key of {key}; allowed: {sorted(allowed)}")
    return values


def check_required(key: str, values: Mapping[str, Any], fields: cf.Fields) -> None:
    """Raise :class:`ConfigError` for a key without a default that ``values`` leaves unset."""
    for name, field in fields.items():
        if field.default is cf.REQUIRED and values.get(name) is None:
            raise ConfigError(f"{key}.{name} is required; set it in the config")


def check_sections(config: config_dict.ConfigDict) -> None:
    """Raise :class:`ConfigError` unless ``config`` has exactly the :data:`SECTIONS`."""
    unknown = sorted(set(config.keys()) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config.{unknown[0]} is not a section; allowed: {list(SECTIONS)}")
    missing = [s for s in SECTIONS if s not in config and s not in OPTIONAL]
    if missing:
        raise ConfigError(f"config.{missing[0]} is missing; a config has {list(SECTIONS)}")


def slots(config, model: Mapping[str, Any], entry: ModelEntry) -> tuple[dict, dict]:
    """Each model slot's level name(s) and the slot of each declared level; raises
    :class:`ConfigError` for a slot naming an undeclared level, a level in no slot, and a
    ``model.level`` that does not go with ``model.mixer`` (``"attention"``, MemoryLM's
    Transformer++, takes none and may declare no levels; every other mixer needs one)."""
    attention = model.get("mixer") == "attention"
    if not attention and ("levels" not in config or not dict(config.levels.items())):
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
            f"declared level, one of {sorted(config.levels.keys())}"
        )
    many_of = cf.model_slots(entry.build, entry.also)
    names_in = {slot: model.get(slot) for slot in many_of}
    slot_of = {}
    for slot, names in names_in.items():
        for name in (names or ()) if many_of[slot] else [names] if names is not None else []:
            if name not in config.levels:
                raise ConfigError(
                    f"model.{slot}={name!r} is not a declared level; allowed: "
                    f"{sorted(config.levels.keys())}"
                )
            slot_of[name] = slot
    for name in config.levels:
        if name not in slot_of:
            raise ConfigError(
                f"levels.{name} is declared but no model slot uses it; set one of "
                f"{[f'model.{s}' for s in names_in]} to {name!r}"
            )
    return names_in, slot_of


def owners(config, outer: str) -> dict[str, str]:
    """Each level's owner (``levels.<name>.owner``, default ``outer``); raises
    :class:`ConfigError` for one that is neither ``outer`` nor another level."""
    names = list(config.levels.keys())
    out = {name: config.levels[name].get("owner") or outer for name in names}
    for name, owner in out.items():
        if owner not in (outer, *names) or owner == name:
            allowed = [outer, *(n for n in names if n != name)]
            raise ConfigError(f"levels.{name}.owner={owner!r} is unknown; allowed: {allowed}")
    return out


# -- writing configs --------------------------------------------------------------------------


def variant(arg: str | None, *, default: str = "delta", others: Sequence[str] = ()) -> str:
    """The variant a config file was given (``configs/x.py:<variant>``): ``arg``, or
    ``default``; a memory rule of :data:`nested.recipes.RULES` or one of ``others``."""
    name = arg or default
    allowed = sorted({*recipes.RULES, *others})
    if name not in allowed:
        raise ConfigError(f"variant {name!r} is unknown; allowed variants: {allowed}")
    return name


def task_config(name: str, **fields) -> config_dict.ConfigDict:
    """The ``task`` section: ``name`` and every field of the task, ``fields`` overriding."""
    return wrapped(None, cf.section, task_fields(name), {"name": name, **fields})


def model_config(name: str, **hyper) -> config_dict.ConfigDict:
    """The ``model`` section: ``name``, the model's hyperparameters and level slots."""
    return wrapped(None, cf.section, model_fields(name), {"name": name, **hyper})


def level_config(rule: str, **fields) -> config_dict.ConfigDict:
    """One ``levels`` entry: ``rule``, ``owner``, the recipe's hyperparameters and the level
    fields it passes on (``persist``, ``read``, ``truncate``, ``first_order``, ``chunk``)."""
    return wrapped(None, cf.section, level_fields(rule), {"rule": rule, **fields})


def optimizer_config(name: str = "adamw", **hyper) -> config_dict.ConfigDict:
    """The ``optimizer`` section: ``name``, ``learning_rate``, the schedule (``schedule``,
    ``warmup_steps``, ``min_lr_ratio``, ``grad_clip``: 0 disables clipping) and every simple
    hyperparameter of the optax function."""
    return wrapped(None, cf.section, optimizer_fields(name), {"name": name, **hyper})


def train_config(*, mesh: Mapping[str, Any] | None = None, **fields) -> config_dict.ConfigDict:
    """The ``train`` section, :data:`TRAIN_DEFAULTS` overridden by ``fields``, and its
    ``mesh`` subsection, :data:`~nested.run.sharding.MESH_DEFAULTS` overridden by ``mesh``,
    and its ``rules`` (:data:`~nested.run.partitioning.RULE_DEFAULTS` overridden by
    ``mesh["rules"]``)."""
    section = wrapped(None, cf.section, cf.plain(TRAIN_DEFAULTS), fields)
    mesh = dict(mesh or {})
    rules = mesh.pop("rules", {})
    section.mesh = wrapped(None, cf.section, cf.plain(MESH_DEFAULTS), mesh)
    section.mesh.rules = wrapped(None, cf.section, cf.plain(RULE_DEFAULTS), rules)
    return section


def plasticity_config(**fields) -> config_dict.ConfigDict:
    """The ``plasticity`` section, :data:`PLASTICITY_DEFAULTS` overridden by ``fields``."""
    return wrapped(None, cf.section, cf.plain(PLASTICITY_DEFAULTS), fields)


def load(spec: str) -> config_dict.ConfigDict:
    """``get_config(variant)`` of the file in ``spec = "path.py[:variant]"`` (as
    ``--config path.py:variant`` does), for notebooks and tests."""
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


def from_json(data: Mapping[str, Any]) -> config_dict.ConfigDict:
    """A config read back from its JSON (a run's ``config.json``) as its file made it: lists
    as tuples and each None as a placeholder of its key's type, so an override
    ``--config.<key>=...`` parses as it does on the file's config. Raises
    :class:`ConfigError` for a name no registry knows (a rule's module no longer
    importable)."""
    config = config_dict.ConfigDict(_tuples(data))
    for prefix, fields in accepted(config).items():
        node = config
        for part in prefix.split("."):
            node = node.get(part) if isinstance(node, config_dict.ConfigDict) else None
        for key, value in (node or {}).items():
            if value is None and key in fields and fields[key].type is not None:
                node[key] = config_dict.placeholder(fields[key].type)
    return config


# -- listing keys -----------------------------------------------------------------------------


def accepted(config: config_dict.ConfigDict) -> dict[str, cf.Fields]:
    """The keys each section of ``config`` accepts (a ``levels.<name>`` section per level),
    with their values in ``config`` as defaults."""
    sections = {
        "task": task_fields(config.task.name),
        "model": model_fields(config.model.name),
        **{
            f"levels.{name}": level_fields(s.rule, f"levels.{name}.rule")
            for name, s in config.levels.items()
        },
        "optimizer": optimizer_fields(config.optimizer.name),
        "train": cf.plain(TRAIN_DEFAULTS),
        "train.mesh": cf.plain(MESH_DEFAULTS),
        "train.mesh.rules": cf.plain(RULE_DEFAULTS),
        "plasticity": cf.plain(PLASTICITY_DEFAULTS),
    }
    out = {}
    for prefix, fields in sections.items():
        node = config
        for part in prefix.split("."):
            node = node.get(part, {})
        out[prefix] = {k: f._replace(default=node.get(k, f.default)) for k, f in fields.items()}
    return out


def registered() -> dict[str, cf.Fields]:
    """The keys of every registered level recipe, model, task and optimizer, and of ``train``
    (``tests/config_keys.txt`` is their :func:`~nested.run.config_fields.listing`)."""
    return {
        **{f"levels[rule={rule}]": level_fields(rule) for rule in sorted(recipes.named())},
        **{f"model[name={name}]": model_fields(name) for name in sorted(MODELS)},
        **{f"task[name={name}]": task_fields(name) for name in sorted(data.TASKS)},
        **{f"optimizer[name={name}]": optimizer_fields(name) for name in sorted(OPTIMIZERS)},
        "train": cf.plain(TRAIN_DEFAULTS),
        "train.mesh": cf.plain(MESH_DEFAULTS),
        "train.mesh.rules": cf.plain(RULE_DEFAULTS),
        "plasticity": cf.plain(PLASTICITY_DEFAULTS),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m nested.run.config CONFIG.py[:variant]`` prints every key the config's
    sections accept, ``section.key  type  value``; ``--registered``, those of every registered
    rule and level recipe, model, task and optimizer, ``section[rule=...].key  type  default``."""
    parser = argparse.ArgumentParser(prog="python -m nested.run.config", description=main.__doc__)
    parser.add_argument("config", nargs="?", help="a config file, path.py[:variant]")
    parser.add_argument(
        "--registered", action="store_true", help="the keys of every registered name instead"
    )
    args = parser.parse_args(argv)
    if (args.config is None) != args.registered:
        parser.error("give a config file or --registered")
    try:
        sections = registered() if args.registered else accepted(load(args.config))
    except ConfigError as error:
        sys.exit(f"error: {error}")
    sys.stdout.write(cf.listing(sections))
