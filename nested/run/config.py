"""Experiment configs: an ``ml_collections.ConfigDict`` -> task, nested system, program.

A config names everything it uses and registries map the names to code, so a new rule, model
or task is available to every config without editing one:

* ``task.name`` -> :data:`nested.data.TASKS`; the other ``task`` keys are the task's fields;
* ``model.name`` -> :data:`MODELS`; the other ``model`` keys are the model's hyperparameters
  and its *level slots*: the model arguments that take fast levels (``MemoryLM``: ``level``,
  the mixer's level, ``projections``, the projection level of the self-modifying mixer, and
  ``cms``, a tuple of CMS levels) hold names of ``levels`` entries;
* ``levels.<name>.rule`` -> :data:`nested.recipes.RULES` (the token-mixing memory rules) or
  :data:`nested.recipes.LEVELS` (the other levels a model can hold: ``cms`` blocks, Hope's
  ``projections``), looked up when the config is built, so a rule registered there is usable
  at once; the other keys are the recipe's hyperparameters and the :class:`nested.Level`
  fields (``every``, ``persist``, ``chunk``, ...), plus ``owner`` (the slower level producing
  its context: the model, the default, or another level, as Hope's memory is owned by its
  ``projections``);
* ``optimizer.name`` -> :data:`OPTIMIZERS`, the outermost level's update rule;
* ``train``: the loop's settings (:data:`TRAIN_DEFAULTS`), with ``train.mesh``, how the run is
  spread over the devices (:data:`MESH_DEFAULTS`, :mod:`nested.run.sharding`).

So ``--config.levels.memory.every=16`` turns the online delta rule into mini-batch TTT.
:func:`build` validates the whole config before anything is compiled and raises
:class:`ConfigError` (a ``ValueError``) with a one-line message naming the key and the allowed
values. The ``*_config`` helpers write a section with every key its target accepts (defaults
read off the signatures), so any key can be overridden from the command line under
``lock_config=True``, which rejects unknown keys.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import optax
from ml_collections import config_dict

from nested import data
from nested.core.level import Level
from nested.core.scheduler import Program, compile
from nested.core.system import NestedSystem
from nested.learn import objectives, recipes
from nested.nn.hybrid import MemoryAsContext
from nested.nn.layers import MemoryLayer
from nested.nn.models import MemoryLM

OUTER = "model"  # name of the outermost level
SECTIONS = ("seed", "task", "model", "levels", "optimizer", "train")
SCHEDULES = ("constant", "cosine")
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": optax.adamw,
    "adam": optax.adam,
    "sgd": optax.sgd,
}
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
    }
)
# train.mesh (nested.run.sharding): `data` devices split the batch (0: every device not on
# `model`), `model` devices split the memory heads; `shard_params` splits the slow parameters
# along `data` too (else they are replicated).
MESH_DEFAULTS = types.MappingProxyType({"data": 0, "model": 1, "shard_params": False})
SCHEDULE_DEFAULTS = types.MappingProxyType(
    {"schedule": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1, "grad_clip": 1.0}
)
# Level fields a recipe passes through **level_kwargs (the recipe fixes the others), with
# their config types: a fast level's `every` is an int.
LEVEL_FIELDS = types.MappingProxyType(
    {
        "every": int,
        "persist": str,
        "read": str,
        "truncate": int,
        "first_order": bool,
        "chunk": int,
    }
)

# Model keys a rule sets in the layer that owns it (recipes.LAYER_OPTIONS: Falcon's key
# shift). They default to None in the model section, meaning "as the slot's rule needs".
RULE_KEYS = frozenset(key for options in recipes.LAYER_OPTIONS.values() for key in options)


class ConfigError(ValueError):
    """An invalid config; the message names the key and the allowed values."""


# -- models ---------------------------------------------------------------------------------


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


def _memory_lm_widths(slot: str, hyper: Mapping[str, Any]) -> tuple[int, int]:
    dim, heads = hyper["dim"], hyper["heads"]
    if slot in ("cms", "projections"):  # a CMS block and Hope's projections map dim -> dim
        return dim, dim
    if not (isinstance(heads, int) and isinstance(dim, int) and heads >= 1 and dim >= 1):
        raise ConfigError(f"model.dim={dim!r} and model.heads={heads!r} must be ints >= 1")
    if dim % heads:
        raise ConfigError(
            f"model.dim={dim} is not divisible by model.heads={heads} (each head's memory is "
            f"dim/heads wide unless levels.*.d_k/d_v are set); allowed heads: {_divisors(dim)}"
        )
    return dim // heads, dim // heads


MODELS: dict[str, ModelEntry] = {
    "memory_lm": ModelEntry(MemoryLM, _memory_lm_widths, also=(MemoryLayer, MemoryAsContext)),
}


# -- reading signatures ---------------------------------------------------------------------


def _value_type(hint: Any) -> type | None:
    """The ConfigDict type of a parameter annotated ``hint``, None if not configurable."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = {_value_type(a) for a in args if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if origin is typing.Literal:
        return type(args[0])
    if origin in (tuple, Sequence) or hint is tuple:
        return tuple
    return hint if hint in (int, float, str, bool) else None


def _slot_kind(hint: Any) -> type | None:
    """A level slot's config type: ``str`` for one level (``Level``, ``Level | None``),
    ``tuple`` for several (``Sequence[Level]``); None if ``hint`` is not a slot."""
    if hint is Level or (
        typing.get_origin(hint) in (typing.Union, types.UnionType)
        and set(typing.get_args(hint)) == {Level, type(None)}
    ):
        return str
    if typing.get_origin(hint) is Sequence and typing.get_args(hint) == (Level,):
        return tuple
    return None


def _parameters(fn: Callable) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """Named parameters of ``fn`` (a class: its ``__init__``), their type hints, and whether it
    takes ``**kwargs``."""
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


def _field(default: Any, kind: type | None):
    if default is not None and default is not inspect.Parameter.empty:
        return tuple(default) if isinstance(default, list) else default
    return config_dict.placeholder(kind)


def _section(fields: Mapping[str, tuple[Any, type | None]], overrides: Mapping[str, Any]):
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; allowed: {sorted(fields)}")
    section = config_dict.ConfigDict()
    for name, (default, kind) in fields.items():
        section[name] = overrides[name] if name in overrides else _field(default, kind)
    return section


def _configurable(fn: Callable, skip: Sequence[str]) -> dict[str, tuple[Any, type | None]]:
    """``{name: (default, type)}`` of the parameters of ``fn`` a config can set."""
    named, hints, _ = _parameters(fn)
    fields = {}
    for name, p in named.items():
        hint = hints.get(name)
        kind = _slot_kind(hint) or _value_type(hint)
        if kind is None and p.default is not p.empty and p.default is not None:
            kind = type(p.default)
        if name not in skip and kind in (int, float, str, bool, tuple):
            fields[name] = (p.default, kind)
    return fields


def _level_fields(rule: str) -> dict[str, tuple[Any, type | None]]:
    recipe = _lookup("levels.*.rule", rule, recipes.named())
    fields = {"rule": (rule, str), "owner": (None, str)}
    fields.update(_configurable(recipe, skip=("name",)))
    if _parameters(recipe)[2]:
        for f in dataclasses.fields(Level):
            if f.name in LEVEL_FIELDS and f.name not in fields:
                fields[f.name] = (f.default, LEVEL_FIELDS[f.name])
    return fields


def _optimizer_fields(name: str) -> dict[str, tuple[Any, type | None]]:
    fn = _lookup("optimizer.name", name, OPTIMIZERS)
    fields = {"name": (name, str), "learning_rate": (None, float)}
    fields.update({k: (v, type(v)) for k, v in SCHEDULE_DEFAULTS.items()})
    fields.update(_configurable(fn, skip=("learning_rate",)))
    return fields


def _task_fields(name: str) -> dict[str, tuple[Any, type | None]]:
    cls = _lookup("task.name", name, data.TASKS)
    hints = typing.get_type_hints(cls)
    fields = {"name": (name, str)}
    for f in dataclasses.fields(cls):
        fields[f.name] = (f.default, _value_type(hints[f.name]))
    return fields


def _model_signatures(entry: ModelEntry) -> list[tuple[Callable, set[str]]]:
    """``(callable, names to skip)`` pairs whose keyword parameters are model keys."""
    own = set(_parameters(entry.build)[0])
    return [(entry.build, {"vocab", "rngs"})] + [(fn, own | {"rngs"}) for fn in entry.also]


def _model_fields(name: str) -> dict[str, tuple[Any, type | None]]:
    entry = _lookup("model.name", name, MODELS)
    fields = {"name": (name, str)}
    for fn, skip in _model_signatures(entry):
        for key, field in _configurable(fn, skip=tuple(skip)).items():
            fields.setdefault(key, field if key not in RULE_KEYS else (None, field[1]))
    return fields


def _rule_options(config, slots: Mapping[str, Any]) -> dict[str, Any]:
    """The layer options (:data:`nested.recipes.LAYER_OPTIONS`) the rules of the levels in
    the model's single-level slots ask for: ``levels.memory.rule=falcon`` gives
    ``key_shift=True`` unless ``model.key_shift`` is set."""
    options = {}
    for names in slots.values():
        if isinstance(names, str):
            options.update(recipes.LAYER_OPTIONS.get(config.levels[names].rule, {}))
    return options


def _model_slots(entry: ModelEntry) -> dict[str, bool]:
    """The model's level slots: ``{name: takes several levels}``."""
    slots = {}
    for fn, skip in _model_signatures(entry):
        named, hints, _ = _parameters(fn)
        for name in named:
            kind = _slot_kind(hints.get(name))
            if name not in skip and kind is not None:
                slots.setdefault(name, kind is tuple)
    return slots


def _lookup(key: str, name: Any, registry: Mapping[str, Any]):
    if name not in registry:
        raise ConfigError(f"{key}={name!r} is unknown; allowed: {sorted(registry)}")
    return registry[name]


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
    return _section(_task_fields(name), {"name": name, **fields})


def model_config(name: str, **hyper) -> config_dict.ConfigDict:
    """The ``model`` section: ``name``, the model's hyperparameters and level slots."""
    return _section(_model_fields(name), {"name": name, **hyper})


def level_config(rule: str, **fields) -> config_dict.ConfigDict:
    """One ``levels`` entry: ``rule``, ``owner``, the recipe's hyperparameters and the level
    fields it passes on (``persist``, ``read``, ``truncate``, ``first_order``, ``chunk``)."""
    return _section(_level_fields(rule), {"rule": rule, **fields})


def optimizer_config(name: str = "adamw", **hyper) -> config_dict.ConfigDict:
    """The ``optimizer`` section: ``name``, ``learning_rate``, the schedule (``schedule``,
    ``warmup_steps``, ``min_lr_ratio``, ``grad_clip``: 0 disables clipping) and every simple
    hyperparameter of the optax function."""
    return _section(_optimizer_fields(name), {"name": name, **hyper})


def train_config(*, mesh: Mapping[str, Any] | None = None, **fields) -> config_dict.ConfigDict:
    """The ``train`` section, :data:`TRAIN_DEFAULTS` overridden by ``fields``, and its
    ``mesh`` subsection, :data:`MESH_DEFAULTS` overridden by ``mesh``."""
    section = _section({k: (v, type(v)) for k, v in TRAIN_DEFAULTS.items()}, fields)
    section.mesh = _section({k: (v, type(v)) for k, v in MESH_DEFAULTS.items()}, mesh or {})
    return section


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


# -- building -------------------------------------------------------------------------------


class Experiment(NamedTuple):
    """A validated config, built: the task, the nested system, its compiled program, and the
    outer learning-rate schedule ``step -> lr`` (for logging)."""

    config: config_dict.ConfigDict
    task: data.Task
    system: NestedSystem
    program: Program
    schedule: Callable[[int], Any]

    @property
    def carries_fast(self) -> bool:
        """Whether some level keeps its fast state across sequences (``persist="stream"``)."""
        return any(level.persist == "stream" for level in self.system.fast_levels)


def _check_keys(key: str, section: Any, allowed: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(section, Mapping | config_dict.ConfigDict):
        raise ConfigError(f"{key} must be a ConfigDict section, got {section!r}")
    values = dict(section.items())
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a key of {key}; allowed: {sorted(allowed)}")
    return values


def _wrapped(key: str, fn: Callable, *args, **kwargs):
    """Call ``fn``; a ValueError/TypeError it raises becomes a ConfigError naming ``key``."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key}: {error}") from error


def _positive(key: str, value: Any, *, zero: bool = False) -> int:
    low = 0 if zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}={value!r} must be an int >= {low}")
    return value


def _required(key: str, values: Mapping[str, Any], fields: Mapping[str, tuple]):
    for name, (default, _) in fields.items():
        if default is inspect.Parameter.empty and values.get(name) is None:
            raise ConfigError(f"{key}.{name} is required; set it in the config")


def _make_task(config) -> data.Task:
    name = config.task.get("name") if "task" in config else None
    fields = _check_keys("task", config.task, _task_fields(name))
    fields.pop("name")
    fields = {k: v for k, v in fields.items() if v is not None}
    return _wrapped("task", data.make_task, name, **fields)


def _make_levels(config, model: Mapping[str, Any], entry: ModelEntry, task: data.Task):
    """The fast levels by name, and each model slot's level name(s)."""
    if "levels" not in config or not dict(config.levels.items()):
        raise ConfigError("levels: declare at least one fast level (levels.<name>.rule=...)")
    many_of = _model_slots(entry)
    slots = {n: model.get(n) for n in many_of}
    slot_of = {}
    for slot, names in slots.items():
        for name in (names or ()) if many_of[slot] else [names] if names is not None else []:
            if name not in config.levels:
                raise ConfigError(
                    f"model.{slot}={name!r} is not a declared level; allowed: "
                    f"{sorted(config.levels.keys())}"
                )
            slot_of[name] = slot
    levels = {}
    for name, section in config.levels.items():
        key = f"levels.{name}"
        if name not in slot_of:
            raise ConfigError(
                f"{key} is declared but no model slot uses it; set one of "
                f"{[f'model.{s}' for s in slots]} to {name!r}"
            )
        rule = section.get("rule")
        _lookup(f"{key}.rule", rule, recipes.named())
        fields = _level_fields(rule)
        values = _check_keys(key, section, fields)
        _check_period(key, values, task)
        for meta in ("rule", "owner"):
            values.pop(meta)
        if "d_k" in fields and (values.get("d_k") is None or values.get("d_v") is None):
            d_k, d_v = entry.widths(slot_of[name], model)
            values["d_k"] = values.get("d_k") or d_k
            values["d_v"] = values.get("d_v") or d_v
        _required(key, values, fields)
        values = {k: v for k, v in values.items() if v is not None}
        level = _wrapped(key, recipes.named()[rule], name, **values)
        if level.is_window and task.seq_len % level.every:
            raise ConfigError(
                f"{key}.every={level.every} does not divide the task's sequence length "
                f"{task.seq_len} (the model runs window by window); allowed: "
                f"{_divisors(task.seq_len)}"
            )
        levels[name] = level
    return levels, slots


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_period(key: str, values: Mapping[str, Any], task: data.Task) -> None:
    """Periods the inner loops can run: chunking is whole update chunks, and levels that see
    a stream across sequences (or learn window by window) see whole ones per sequence."""
    every = _positive(f"{key}.every", values.get("every", 1))
    for field in ("chunk", "truncate"):
        value = values.get(field)
        if value is not None and (_positive(f"{key}.{field}", value) % every):
            raise ConfigError(
                f"{key}.{field}={value} is not a multiple of {key}.every={every}; allowed: "
                f"multiples of {every}, e.g. {[every * i for i in range(1, 5)]}"
            )
    if values.get("persist") == "stream" and task.seq_len % every:
        raise ConfigError(
            f"{key}.every={every} does not divide the sequence length {task.seq_len} of the "
            f"task, so a stream carried across sequences would break its update chunks; "
            f"allowed: {_divisors(task.seq_len)}"
        )


def _check_train(config, carries_fast: bool) -> dict[str, Any]:
    train = _check_keys("train", config.train, {**TRAIN_DEFAULTS, "mesh": MESH_DEFAULTS})
    mesh = {**MESH_DEFAULTS, **_check_keys("train.mesh", train.pop("mesh", {}), MESH_DEFAULTS)}
    _positive("train.mesh.data", mesh["data"], zero=True)
    _positive("train.mesh.model", mesh["model"])
    if not isinstance(mesh["shard_params"], bool):
        raise ConfigError(f"train.mesh.shard_params={mesh['shard_params']!r} must be True or False")
    train = {**TRAIN_DEFAULTS, **train}
    for name, value in train.items():
        if isinstance(TRAIN_DEFAULTS[name], bool):
            if not isinstance(value, bool):
                raise ConfigError(f"train.{name}={value!r} must be True or False")
        else:
            _positive(f"train.{name}", value)
    k = train["steps_per_call"]
    for name in ("log_every", "eval_every", "checkpoint_every"):
        if train[name] % k:
            raise ConfigError(
                f"train.{name}={train[name]} is not a multiple of train.steps_per_call={k}; "
                f"allowed: multiples of {k}"
            )
    if train["checkpoint_every"] % train["log_every"]:
        raise ConfigError(
            f"train.checkpoint_every={train['checkpoint_every']} is not a multiple of "
            f"train.log_every={train['log_every']} (a resumed run must log the same windows); "
            f"allowed: multiples of {train['log_every']}"
        )
    if carries_fast and train["eval_batch_size"] != train["batch_size"]:
        raise ConfigError(
            f"train.eval_batch_size={train['eval_batch_size']} must equal train.batch_size="
            f"{train['batch_size']}: a level with persist='stream' evaluates from the carried "
            f"fast state, one per batch row; allowed: {train['batch_size']}"
        )
    return {**train, "mesh": mesh}


def _make_optimizer(config, steps: int):
    name = config.optimizer.get("name")
    _lookup("optimizer.name", name, OPTIMIZERS)
    hyper = _check_keys("optimizer", config.optimizer, _optimizer_fields(name))
    lr = hyper.pop("learning_rate")
    if not isinstance(lr, int | float) or lr <= 0:
        raise ConfigError(f"optimizer.learning_rate={lr!r} must be a positive number")
    schedule, warmup = hyper.pop("schedule"), hyper.pop("warmup_steps")
    min_ratio, clip = hyper.pop("min_lr_ratio"), hyper.pop("grad_clip")
    hyper.pop("name")
    if schedule not in SCHEDULES:
        raise ConfigError(f"optimizer.schedule={schedule!r} is unknown; allowed: {SCHEDULES}")
    if not (isinstance(warmup, int) and 0 <= warmup < steps):
        raise ConfigError(
            f"optimizer.warmup_steps={warmup!r} must be an int in [0, train.steps={steps})"
        )
    if schedule == "constant":  # a linear warmup stays at its end value
        lr_fn = optax.linear_schedule(0.0, lr, warmup) if warmup else optax.constant_schedule(lr)
    else:
        lr_fn = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * min_ratio)
    tx = _wrapped("optimizer", OPTIMIZERS[name], learning_rate=lr_fn, **hyper)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    return tx, lr_fn


def build(config: config_dict.ConfigDict) -> Experiment:
    """Validate ``config`` and build its task, system and program (nothing is traced).

    Raises :class:`ConfigError` naming the bad key and its allowed values.
    """
    unknown = sorted(set(config.keys()) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config.{unknown[0]} is not a section; allowed: {list(SECTIONS)}")
    missing = [s for s in SECTIONS if s not in config]
    if missing:
        raise ConfigError(f"config.{missing[0]} is missing; a config has {list(SECTIONS)}")
    _positive("seed", config.seed, zero=True)
    task = _make_task(config)
    entry = _lookup("model.name", config.model.get("name"), MODELS)
    fields = _model_fields(config.model.name)
    model = _check_keys("model", config.model, fields)
    _required("model", model, fields)
    levels, slots = _make_levels(config, model, entry, task)
    carries_fast = any(level.persist == "stream" for level in levels.values())
    segment = model.get("window")
    if model.get("mixer") == "context" and carries_fast and task.seq_len % (segment or 1):
        raise ConfigError(
            f"model.window={segment} (the memory-as-context segment) does not divide the "
            f"sequence length {task.seq_len}: a stream carried across sequences would restart "
            f"a segment inside each sequence; allowed: {_divisors(task.seq_len)}"
        )
    train = _check_train(config, carries_fast)
    tx, schedule = _make_optimizer(config, train["steps"])

    # Keys of the `also` callables are passed only when set, so a model whose **kwargs go
    # to another callable (another mixer) never receives keys it does not take.
    own = set(_parameters(entry.build)[0])
    hyper = {
        k: v
        for k, v in model.items()
        if k != "name" and k not in slots and (k in own or v != fields[k][0])
    }
    for key, value in _rule_options(config, slots).items():
        if model.get(key) is None:
            hyper[key] = value
    for slot, names in slots.items():
        if isinstance(names, str):
            hyper[slot] = levels[names]
        elif names is not None:
            hyper[slot] = tuple(levels[n] for n in names)
    factory = lambda rngs: entry.build(vocab=task.vocab_size, rngs=rngs, **hyper)
    outer = _wrapped(
        "optimizer",
        Level,
        OUTER,
        memory=factory,
        objective=objectives.next_token,
        update=tx,
        every="step",
    )
    owners = {name: config.levels[name].get("owner") or OUTER for name in levels}
    for name, owner in owners.items():
        if owner not in (OUTER, *levels) or owner == name:
            allowed = [OUTER, *(n for n in levels if n != name)]
            raise ConfigError(f"levels.{name}.owner={owner!r} is unknown; allowed: {allowed}")
    system = _wrapped("levels", NestedSystem, [outer, *levels.values()], owners=owners)
    program = _wrapped("model", compile, system, skip_nonfinite=train["skip_nonfinite"])
    return Experiment(config, task, system, program, schedule)
