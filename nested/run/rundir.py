"""A run's folder (``--workdir``): the files it holds, its checks, the config it records and
the checkpoint it resumes from.

``config.json`` (the config of the run, :func:`record_config`), ``checkpoints/`` (orbax,
:mod:`nested.run.checkpoint`), ``metrics.jsonl`` and ``curves.png`` (:mod:`nested.run.metrics`),
``eval.json`` (the latest checkpoint's evaluation), ``sessions.jsonl`` (one line per memory
session) and ``run.lock`` (held by the run writing the folder, :mod:`nested.run.locks`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jax
from absl import logging
from ml_collections import config_dict

from nested import files
from nested.run import checkpoint, distributed, sharding
from nested.run import config as config_lib
from nested.run.config import ConfigError, Experiment
from nested.run.pieces import init_state

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
EVAL_FILE = "eval.json"  # the evaluation of the latest checkpoint
SESSIONS_FILE = "sessions.jsonl"  # one line per memory session, appended
LOCK_FILE = "run.lock"  # held by the training run writing the workdir (nested.run.locks)


def _flat(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple | list) else value
    return out


def record_config(config: config_dict.ConfigDict, workdir: Path, step: int) -> None:
    """Write ``config.json`` as the run starts at ``step`` (0, or the checkpoint it resumes
    from). When the saved one has other values, warn naming the keys and keep it as
    ``config.<step>.json``, the config of the steps up to ``step``."""
    path = workdir / CONFIG_FILE
    current = json.loads(config.to_json_best_effort())
    if path.exists():
        saved = path.read_text(errors="replace")
        try:
            before = _flat(json.loads(saved))
        except json.JSONDecodeError as error:
            logging.warning("%s is unreadable (%s); replacing it", path, error)
            before = _flat(current)
        now = _flat(current)
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if changed:
            kept = workdir / f"config.{step}.json"
            files.write_atomic(kept, saved)
            logging.warning(
                "config differs from the one saved in %s: %s; that one is kept as %s",
                path,
                changed,
                kept,
            )
    files.write_atomic(path, json.dumps(current, indent=2) + "\n")


def check_workdir(workdir: Path) -> None:
    """Raise :class:`ConfigError` naming ``workdir`` and the fix when it is a file or cannot be
    created or written to. It is created to find out, then removed again if it was new (with
    the parents made for it): a run that fails to build leaves nothing behind. (Not in a
    multi-process run: the processes check it side by side, and it stays.)"""
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir {workdir} is a file; pass a folder (new or of this run)")
    new = [path for path in (workdir, *workdir.parents) if not path.exists()]  # deepest first
    if jax.process_count() > 1:
        new = []
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as error:
        raise ConfigError(
            f"workdir {workdir} cannot be created or written to ({error.strerror}); pass a "
            "folder you can write to (new or of this run)"
        ) from error
    finally:
        for path in new:
            with contextlib.suppress(OSError):
                path.rmdir()


def check_run(workdir: str | Path) -> Path:
    """The checkpoint folder of the run in ``workdir``; raises :class:`ConfigError` when there
    is no run there (no checkpoint folder)."""
    directory = Path(workdir) / CHECKPOINTS
    if not directory.is_dir():
        raise ConfigError(
            f"no run in --workdir {workdir} (no {CHECKPOINTS} folder): train one there first "
            f"(experiments/train.py --workdir {workdir})"
        )
    return directory


def check_same_config(config: config_dict.ConfigDict, workdir: Path) -> None:
    """Every process of a multi-process run must run the same loop on the same model."""
    distributed.check_same(
        f"{config.to_json_best_effort(sort_keys=True)}\n{workdir.absolute()}",
        "config or --workdir",
        "start every process with the same command line (only the process flags differ)",
    )


def restore_latest(
    exp: Experiment, directory: Path, layout: sharding.Layout | None = None, step=None
) -> checkpoint.Restored:
    """The latest readable checkpoint of ``directory`` (``step``: that one) restored into the
    state of ``exp`` (on ``layout``'s shardings when given); raises
    :class:`nested.run.checkpoint.CheckpointError` when none is readable (damaged ones are
    set aside, as the checkpointer does)."""
    cfg = exp.config.train
    every, keep = cfg.checkpoint_every, cfg.keep_checkpoints
    with checkpoint.Checkpointer(directory, every=every, keep=keep) as ckpt:
        restored = ckpt.restore_latest(init_state(exp, layout), step)
    if restored is None:
        which = "readable checkpoint" if step is None else f"readable checkpoint of step {step}"
        raise checkpoint.CheckpointError(f"no {which} in {directory}")
    return restored


def load_workdir_config(workdir: str | Path) -> config_dict.ConfigDict:
    """The config a run in ``workdir`` was trained with (typed as its config file made it:
    :func:`nested.run.config_schema.from_json`)."""
    check_run(workdir)
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(
            f"--workdir {workdir} has no {CONFIG_FILE}; pass --config, the file it was trained with"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a readable config ({error}); pass --config") from error
    return config_lib.from_json(data)
