"""Tiny versions of the shipped configs for the tests of the experiment workflow.

Each is a shipped config file plus overrides (``dotted.key -> value``), applied in-process by
:func:`config` or passed to the entry points as ``--config.<key>=<value>`` by :func:`flags`,
so the tests run the same configs the commands of README.md and docs/ do, in seconds.
"""

import shutil

from helpers import ROOT
from nested.run import config as nc

_TRAIN = {
    "optimizer.warmup_steps": 1,
    "train.steps": 8,
    "train.batch_size": 4,
    "train.log_every": 2,
    "train.eval_every": 4,
    "train.checkpoint_every": 4,
    "train.eval_batches": 2,
    "train.eval_batch_size": 4,
}
TINY = {
    "lm": {"task.seq_len": 32, "task.documents": True, **_TRAIN},  # set task.path too
    "mqar": {
        "task.vocab_size": 16,
        "task.train_settings": ((16, 2), (16, 4)),
        "task.test_settings": ((16, 2), (16, 4)),
        "model.dim": 16,
        "model.heads": 2,
        **_TRAIN,
    },
    "continual": {
        "task.vocab_size": 32,
        "task.num_keys": 8,
        "task.num_pairs": 3,
        "task.num_queries": 3,
        "task.num_tasks": 2,
        "task.switch_every": 4,
        "model.dim": 16,
        "model.heads": 2,
        **_TRAIN,
    },
    "companion": {
        "task.num_features": 8,
        "task.num_labels": 4,
        "task.events": 4,
        "task.sessions": 2,
        "task.session_length": 2,
        "task.drift_session": 1,
        "model.dim": 16,
        "model.heads": 2,
        **_TRAIN,
    },
}


def path(name: str) -> str:
    return str(ROOT / "configs" / f"{name}.py")


def override(config, overrides):
    """Set ``dotted.key -> value`` entries on ``config`` (in place) and return it."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def config(name: str, **more):
    """The tiny config ``name``; ``more`` adds overrides with ``__`` for dots."""
    extra = {k.replace("__", "."): v for k, v in more.items()}
    return override(nc.load(path(name)), {**TINY[name], **extra})


def flags(name: str, **more) -> list[str]:
    """The command-line flags selecting the tiny config ``name``."""
    extra = {k.replace("__", "."): v for k, v in more.items()}
    overrides = {**TINY[name], **extra}
    return [f"--config={path(name)}"] + [f"--config.{k}={v}" for k, v in overrides.items()]


def resumable_copy(workdir, target):
    """A copy of a finished tiny run's workdir (``train.steps=8``, ``checkpoint_every=4``) as it
    was right after the checkpoint of step 4."""
    shutil.copytree(workdir, target)
    shutil.rmtree(target / "checkpoints" / "8")
    return target
