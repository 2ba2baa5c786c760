"""Experiment configs: an ``ml_collections.ConfigDict`` -> task, nested system, program.

A config's sections name the code they configure and hold its parameters
(:mod:`nested.run.config_schema`: the registries, each section's keys, the ``*_config``
helpers writing a section with every key, :func:`load`, :func:`variant`; all importable from
here), so ``--config.levels.memory.every=16`` turns the online delta rule into mini-batch
TTT. :func:`build` checks the whole config before anything is compiled; a :class:`ConfigError`
(a ``ValueError``) is one line naming the key and the allowed values. Every key a config
accepts, with its type and value::

    python -m nested.run.config configs/mqar.py[:variant]
    python -m nested.run.config --registered  # of every registered rule, model, task, optimizer
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optax
from ml_collections import config_dict

from nested import data
from nested.core.level import Level
from nested.core.scheduler import Program, compile
from nested.core.system import NestedSystem
from nested.learn import objectives
from nested.levels import recipes
from nested.run import config_fields as cf
from nested.run import config_schema as schema
from nested.run.config_schema import MODELS, OPTIMIZERS, SETTINGS, ConfigError
from nested.run.sharding import check_mesh

# Defined in config_schema and used from here by configs, tests and the entry points:
load, from_json, variant = schema.load, schema.from_json, schema.variant
task_config, model_config, level_config = (
    schema.task_config,
    schema.model_config,
    schema.level_config,
)
optimizer_config, train_config = schema.optimizer_config, schema.train_config
plasticity_config = schema.plasticity_config
OUTER = "model"  # name of the outermost level
SMOKE_STEPS = 10  # the most steps of a train.smoke=True run


class Experiment(NamedTuple):
    """A checked config, built: the task, the nested system, its compiled program, the outer
    learning-rate schedule ``step -> lr`` (for logging) and the ``plasticity`` settings."""

    config: config_dict.ConfigDict
    task: data.Task
    system: NestedSystem
    program: Program
    schedule: Callable[[int], Any]
    plasticity: dict[str, Any]

    @property
    def carries_fast(self) -> bool:
        """Whether some level keeps its fast state across sequences (``persist="stream"``)."""
        return any(level.persist == "stream" for level in self.system.fast_levels)


def _positive(key: str, value: Any, *, zero: bool = False) -> int:
    low = 0 if zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}={value!r} must be an int >= {low}")
    return value


def _multiple(key: str, value: int, of_key: str, of: int, otherwise: str) -> None:
    if value % of:
        raise ConfigError(
            f"{key}={value} is not a multiple of {of_key}={of}; allowed: multiples of {of}, "
            + otherwise
        )


def check_settings(key: str, cls: type, section: Any, *, also=()) -> dict[str, Any]:
    """The section ``key`` of the settings dataclass ``cls`` (keys of its own and of ``also``;
    its defaults where unset), each value checked by its annotation: a ``Literal`` one of its
    values, a ``bool`` True or False, a ``float`` a number in [0, 1], an ``int`` >= 1 (>= 0
    where its default is 0: off)."""
    values = schema.check_keys(key, section, [*SETTINGS[key], *also])
    values, hints = {**dataclasses.asdict(cls()), **values}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, value, hint = f"{key}.{f.name}", values[f.name], hints[f.name]
        if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            raise ConfigError(f"{name}={value!r} is unknown; allowed: {typing.get_args(hint)}")
        if hint is bool and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be True or False")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if hint is float and not (number and 0 <= value <= 1):
            raise ConfigError(f"{name}={value!r} must be a number in [0, 1]")
        if hint is int:
            _positive(name, value, zero=f.default == 0)
    return values


def _make_level(name: str, section, task: data.Task, widths: Callable[[], tuple[int, int]]):
    """The level ``levels.<name>`` declares; ``widths()``: the model's ``(d_k, d_v)`` for it.
    Its periods are ones the inner loops can run: chunks of whole update periods, and whole
    periods per sequence where a level is carried across sequences or learns span by span."""
    key, rule = f"levels.{name}", section.get("rule")
    recipe = schema.recipe(f"{key}.rule", rule)
    fields = cf.level_fields(rule, recipe)
    # an unset (None) option of another rule, left by a --config...rule override, is no error
    values = {k: v for k, v in section.items() if k in fields or v is not None}
    values = schema.check_keys(key, values, fields)
    every = _positive(f"{key}.every", values.get("every", 1))
    for field in (f for f in ("chunk", "truncate") if values.get(f) is not None):
        value, e_g = _positive(f"{key}.{field}", values[field]), [every * i for i in range(1, 5)]
        _multiple(f"{key}.{field}", value, f"{key}.every", every, f"e.g. {e_g}")
    if values.get("persist") == "stream" and task.seq_len % every:
        raise ConfigError(
            f"{key}.every={every} does not divide the sequence length {task.seq_len} of the "
            "task, so a stream carried across sequences would break its update chunks; "
            f"allowed: {schema.divisors(task.seq_len)}"
        )
    if "d_k" in fields and (values.get("d_k") is None or values.get("d_v") is None):
        d_k, d_v = widths()
        values["d_k"], values["d_v"] = values.get("d_k") or d_k, values.get("d_v") or d_v
    schema.check_required(key, values, fields)
    values = {k: v for k, v in values.items() if v is not None and k not in ("rule", "owner")}
    level = schema.wrapped(key, recipe, name, **values)
    if not isinstance(level, Level):
        raise ConfigError(
            f"{key}.rule={rule!r} returned a {type(level).__name__}, not a nested.Level; a "
            "recipe is (name, *, d_k, d_v, **level_kwargs) -> nested.Level"
        )
    if level.learns_outer_loss and task.seq_len % level.every:
        raise ConfigError(
            f"{key}.every={level.every} does not divide the task's sequence length "
            f"{task.seq_len} (the model runs period by period); allowed: "
            f"{schema.divisors(task.seq_len)}"
        )
    return level


def _check_train(config, carries_fast: bool) -> dict[str, Any]:
    """The ``train`` section checked (:func:`check_settings`; its ``mesh``:
    :func:`nested.run.sharding.check_mesh`): an interval of ``train.steps`` or more means at
    the end only (the loop always logs, evaluates and checkpoints the last step)."""
    train = check_settings("train", schema.Train, config.train, also=["mesh"])
    mesh_keys, rules = [*SETTINGS["train.mesh"], "rules"], SETTINGS["train.mesh.rules"]
    mesh = schema.check_keys("train.mesh", train.get("mesh", {}), mesh_keys)
    mesh["rules"] = schema.check_keys("train.mesh.rules", mesh.get("rules", {}), rules)
    train["mesh"] = schema.wrapped(None, check_mesh, mesh)
    steps, k, rows = train["steps"], train["steps_per_call"], train["batch_size"]
    for name in (n for n in ("log_every", "eval_every", "checkpoint_every") if train[n] < steps):
        end = f"or train.steps={steps} and more (at the end only)"
        _multiple(f"train.{name}", train[name], "train.steps_per_call", k, end)
    if carries_fast and train["eval_batch_size"] != rows:
        raise ConfigError(
            f"train.eval_batch_size={train['eval_batch_size']} must equal train.batch_size="
            f"{rows}: a level with persist='stream' evaluates from the carried fast state, one "
            f"per batch row; allowed: {rows}"
        )
    if rows % train["microbatches"]:
        raise ConfigError(
            f"train.microbatches={train['microbatches']} does not divide train.batch_size="
            f"{rows}; allowed: {schema.divisors(rows)}"
        )
    return train


def plasticity_settings(config) -> dict[str, Any]:
    """The ``plasticity`` section checked (:func:`check_settings`; none: the defaults), its
    ``every`` a multiple of ``train.steps_per_call``."""
    settings = check_settings("plasticity", schema.Plasticity, config.get("plasticity") or {})
    k = config.train.get("steps_per_call", 1)
    _multiple("plasticity.every", settings["every"], "train.steps_per_call", k, "or 0 (off)")
    return settings


def _make_optimizer(config, steps: int):
    """The outer update rule and its learning-rate schedule ``step -> lr``."""
    name = config.optimizer.get("name")
    hyper = schema.check_keys("optimizer", config.optimizer, schema.optimizer_fields(name))
    lr = hyper.pop("learning_rate")
    if not isinstance(lr, int | float) or lr <= 0:
        raise ConfigError(f"optimizer.learning_rate={lr!r} must be a positive number")
    schedule, warmup, min_ratio, clip = (hyper.pop(f) for f in cf.dataclass_fields(schema.Schedule))
    allowed = typing.get_args(typing.get_type_hints(schema.Schedule)["schedule"])
    if schedule not in allowed:
        raise ConfigError(f"optimizer.schedule={schedule!r} is unknown; allowed: {allowed}")
    if not (isinstance(warmup, int) and 0 <= warmup < steps):
        raise ConfigError(
            f"optimizer.warmup_steps={warmup!r} must be an int in [0, train.steps={steps}); "
            "lower it, or set train.smoke=True for a short check run"
        )
    if schedule == "constant":  # a linear warmup stays at its end value
        lr_fn = optax.linear_schedule(0.0, lr, warmup) if warmup else optax.constant_schedule(lr)
    else:
        lr_fn = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * min_ratio)
    del hyper["name"]
    tx = schema.wrapped("optimizer", OPTIMIZERS[name], learning_rate=lr_fn, **hyper)
    return (optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx), lr_fn


def _model_hyper(config, model, entry, slots, levels) -> dict[str, Any]:
    """The model's keyword arguments: its hyperparameters, its slots' levels, and the layer
    options the rules of its single-level slots ask for (:data:`nested.recipes.LAYER_OPTIONS`:
    ``rule=falcon`` gives ``key_shift=True``) unless the model sets them. Keys of the ``also``
    callables are passed only when set, so that a model whose ``**kwargs`` go to another
    callable (another mixer) never receives keys it does not take."""
    own, fields = set(cf.parameters(entry.build)[0]), schema.model_fields(config.model.name)
    hyper = {
        k: v
        for k, v in model.items()
        if k != "name" and k not in slots and (k in own or v != fields[k].default)
    }
    options = {}
    for slot, names in slots.items():
        if isinstance(names, str):
            options.update(recipes.LAYER_OPTIONS.get(config.levels[names].rule, {}))
            hyper[slot] = levels[names]
        elif names is not None:
            hyper[slot] = tuple(levels[n] for n in names)
    return {**hyper, **{k: v for k, v in options.items() if model.get(k) is None}}


def document_grid(model: Mapping[str, Any], levels: Mapping[str, Level]) -> int:
    """Where the documents of a packed row should start for the model: the least common
    multiple of every fast level's update period (a chunked kernel then runs one base state a
    chunk, not one per document and period inside it: ``nested.ops.documents``), the shortest
    period of the levels learning from the outer loss (CMS spans, ``nested.core.outer_loss``)
    and the memory-as-context segment (``model.window`` with ``mixer="context"``): those two
    count from a row's start, so a document runs as if alone only when it starts on their
    grid. 1 when none. The task ``tokens`` aligns documents to it (its ``align``)."""
    inner = [level.every for level in levels.values() if not level.learns_outer_loss]
    outer = [level.every for level in levels.values() if level.learns_outer_loss]
    grid = math.lcm(1, *inner, min(outer, default=1))
    if model.get("mixer") == "context" and model.get("window"):
        grid = math.lcm(grid, model["window"])
    return grid


def as_run(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """The config a run uses: ``config``, or with ``train.smoke=True`` a copy cut to a short
    check that it trains, evaluates and checkpoints end to end: at most :data:`SMOKE_STEPS`
    steps, a log after every call, one evaluation (of one batch per split) and one checkpoint
    at the end, ``optimizer.warmup_steps`` at most half the steps; all else is the config's."""
    if config.train.get("smoke") is not True:
        return config
    config = copy.deepcopy(config)
    train = config.train
    steps = min(_positive("train.steps", train.steps), SMOKE_STEPS)
    log_every = _positive("train.steps_per_call", train.steps_per_call)
    train.update(steps=steps, log_every=log_every, eval_every=steps, checkpoint_every=steps)
    train.eval_batches = 1
    if isinstance(config.optimizer.get("warmup_steps"), int):
        config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, steps // 2)
    return config


def build(config: config_dict.ConfigDict) -> Experiment:
    """Check ``config`` and build its task, system and program (nothing is traced); the
    experiment holds the config as run (:func:`as_run`). A :class:`ConfigError` names the bad
    key and its allowed values."""
    schema.check_sections(config)
    config = as_run(config)
    _positive("seed", config.seed, zero=True)
    name = config.task.get("name")
    task = schema.check_keys("task", config.task, schema.task_fields(name))
    task = {k: v for k, v in task.items() if k != "name" and v is not None}
    task = schema.wrapped("task", data.make_task, name, **task)
    entry = schema.lookup("model.name", config.model.get("name"), MODELS)
    fields = schema.model_fields(config.model.name)
    model = schema.check_keys("model", config.model, fields)
    schema.check_required("model", model, fields)
    slots, slot_of = schema.slots(config, model, entry)
    levels = {
        name: _make_level(name, s, task, functools.partial(entry.widths, slot_of[name], model))
        for name, s in config.levels.items()
    }
    if getattr(task, "align", 1) is None and getattr(task, "documents", False):
        task = dataclasses.replace(task, align=document_grid(model, levels))
    carries_fast = any(level.persist == "stream" for level in levels.values())
    segment = model.get("window")
    if model.get("mixer") == "context" and carries_fast and task.seq_len % (segment or 1):
        raise ConfigError(
            f"model.window={segment} (the memory-as-context segment) does not divide the "
            f"sequence length {task.seq_len}: a stream carried across sequences would restart "
            f"a segment inside each sequence; allowed: {schema.divisors(task.seq_len)}"
        )
    train = _check_train(config, carries_fast)
    plasticity = plasticity_settings(config)
    tx, schedule = _make_optimizer(config, train["steps"])
    hyper = _model_hyper(config, model, entry, slots, levels)
    factory = lambda rngs: entry.build(vocab=task.vocab_size, rngs=rngs, **hyper)
    outer = schema.wrapped(
        "optimizer", Level, OUTER, factory, objectives.next_token, update=tx, every="step"
    )
    owners = schema.owners(config, OUTER)
    system = schema.wrapped("levels", NestedSystem, [outer, *levels.values()], owners=owners)
    program = schema.wrapped(
        "model",
        compile,
        system,
        skip_nonfinite=train["skip_nonfinite"],
        compute_dtype=None if train["dtype"] == "float32" else train["dtype"],
        microbatches=train["microbatches"],
        document_grid=getattr(task, "document_grid", 1),
    )
    return Experiment(config, task, system, program, schedule, plasticity)


if __name__ == "__main__":
    schema.main()
