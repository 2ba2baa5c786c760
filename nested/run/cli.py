"""Helpers for the absl entry points in ``experiments/``: mistakes end in one readable line.

A user mistake (a typo in an override, an unknown rule, an inconsistent config, a missing
config file, a non-finite loss, an unusable checkpoint) ends the program with one line on
stderr, ``error: ...``, and exit status 1; anything else is a bug and keeps its traceback.

* :func:`parse_flags` is the ``flags_parser`` of ``absl.app.run``. ml_collections reports an
  unknown override key (``--config.model.dimm=3``) as a long ``AttributeError`` traceback;
  here it becomes ``error: --config.model.dimm: config.model has no key 'dimm'; allowed:
  [...]``.
* :func:`user_errors` wraps ``main``: it turns :data:`USER_ERRORS` into that one line, and a
  run stopped by SIGTERM or Ctrl-C (:class:`nested.run.stopping.Stopped`, after its checkpoint)
  into one line and exit status 128 + the signal (143, 130), as a shell reports a process the
  signal ended.
* With ``config_from_workdir=True`` (``eval.py``), ``--config.<key>=<value>`` overrides
  without ``--config`` apply to the config of ``--workdir``'s run (its ``config.json``); they
  may change the ``task`` and ``train`` sections (what is evaluated, and how), not the model.
* :func:`run` starts an entry point: ``absl.app.run`` with :func:`parse_flags`, JAX's note that
  it found no TPU hidden (:func:`not_the_tpu_note`), and the current folder importable (as
  ``python -m`` makes it), so ``levels.<name>.rule=my_rules:recipe`` finds ``my_rules.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from absl import app, flags
from ml_collections import config_dict, config_flags

from nested.core.guards import NonFiniteError
from nested.run import config as config_lib
from nested.run import locks, rundir, stopping
from nested.run.checkpoint import CheckpointError
from nested.run.distributed import DistributedError
from nested.run.memory_state import MemoryStateError

HELP_FLAGS = {"--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml"}
USER_ERRORS = (
    config_lib.ConfigError,
    NonFiniteError,
    CheckpointError,
    MemoryStateError,
    DistributedError,
    locks.Busy,
)
CONFIG_FLAG = "config"
WORKDIR_FLAG = "workdir"
WORKDIR_SECTIONS = ("task", "train")  # what an override of a workdir's config may change


def _one_line(error: BaseException) -> str:
    # str(KeyError("x")) is "'x'": use the message itself.
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(text).split())


def _config_spec(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in ``argv``, None without one."""
    for arg, after in zip(argv, [*argv[1:], None], strict=True):
        if arg.startswith(f"--{CONFIG_FLAG}="):
            return arg.split("=", 1)[1]
        if arg == f"--{CONFIG_FLAG}":
            return after
    return None


def _unknown_override(argv: Sequence[str], config) -> str | None:
    """The first ``--config.<path>=...`` whose path is not in ``config``, explained."""
    prefix = f"--{CONFIG_FLAG}."
    for path in (a[len(prefix) :].split("=", 1)[0] for a in argv if a.startswith(prefix)):
        node, walked = config, CONFIG_FLAG
        for key in path.split("."):
            if not isinstance(node, config_dict.ConfigDict):
                return f"{prefix}{path}: {walked} is a value, not a section"
            if key not in node:
                return f"{prefix}{path}: {walked} has no key {key!r}; allowed: {sorted(node)}"
            node, walked = node[key], f"{walked}.{key}"
    return None


def _flag_error(argv: Sequence[str], error: BaseException) -> str:
    """What went wrong parsing ``argv``: the config file's error, an unknown override, or
    ``error``."""
    spec = _config_spec(argv)
    if spec is None:
        return _one_line(error)
    try:
        config = config_lib.load(spec)
    except config_lib.ConfigError as load_error:
        return f"--{CONFIG_FLAG} {spec}: {_one_line(load_error)}"
    except Exception as load_error:  # noqa: BLE001 - an error inside the config file
        return f"--{CONFIG_FLAG} {spec}: get_config() failed: {_one_line(load_error)}"
    return _unknown_override(argv, config) or _one_line(error)


def workdir_config(workdir: str, overrides: Sequence[str]) -> config_dict.ConfigDict:
    """The config of the run in ``workdir`` with the ``--config.<key>=<value>`` arguments
    ``overrides`` (of :data:`WORKDIR_SECTIONS` only) applied as ml_collections applies them to
    a config file's config; a :class:`ConfigError` names a bad one."""
    for arg in overrides:
        if not arg.startswith(tuple(f"--{CONFIG_FLAG}.{s}." for s in WORKDIR_SECTIONS)):
            raise config_lib.ConfigError(
                f"{arg.split('=', 1)[0]}: evaluating --workdir's run keeps its model; overrides "
                f"may change {[f'{s}.*' for s in WORKDIR_SECTIONS]} (or pass --{CONFIG_FLAG}, "
                "a config file)"
            )
    config = rundir.load_workdir_config(workdir)
    values, argv = flags.FlagValues(), [CONFIG_FLAG, *overrides]
    try:  # the definition already applies the overrides' types
        config_flags.DEFINE_config_dict(CONFIG_FLAG, config, flag_values=values, sys_argv=argv)
        values(argv)
    except Exception as error:  # noqa: BLE001 - ml_collections raises all sorts
        message = _unknown_override(overrides, config) or _one_line(error)
        raise config_lib.ConfigError(message) from error
    return values[CONFIG_FLAG].value


def parse_flags(argv: Sequence[str], *, config_from_workdir: bool = False) -> list[str]:
    """Parse ``argv`` into ``absl.flags.FLAGS``, or exit with one line. With
    ``config_from_workdir``, overrides without ``--config`` apply to the workdir's config."""
    overrides = [a for a in argv[1:] if a.startswith(f"--{CONFIG_FLAG}.")]
    from_workdir = config_from_workdir and overrides and _config_spec(argv) is None
    if from_workdir:
        argv = [a for a in argv if a not in overrides]
    try:
        rest = flags.FLAGS(argv)
    except SystemExit:  # absl's help flags print the usage, then exit 1: asked for, it is 0
        if HELP_FLAGS.intersection(argv):
            sys.exit(0)
        raise
    except Exception as error:  # noqa: BLE001 - ml_collections raises all sorts
        sys.exit(f"error: {_flag_error(argv, error)}")
    if len(rest) > 1:
        sys.exit(f"error: unexpected arguments {rest[1:]}; flags look like --name=value")
    with user_errors():
        if from_workdir:
            flags.FLAGS[CONFIG_FLAG].value = workdir_config(
                flags.FLAGS[WORKDIR_FLAG].value, overrides
            )
    value = flags.FLAGS[CONFIG_FLAG].value if CONFIG_FLAG in flags.FLAGS else None
    if value is not None and not isinstance(value, config_dict.ConfigDict):
        # ml_collections defers a file that fails to load until the config is read.
        cause = getattr(value, "_error", None) or OSError("the config could not be loaded")
        sys.exit(f"error: {_flag_error(argv, cause)}")
    return rest


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors of :data:`USER_ERRORS` into ``error: <message>`` and exit status 1,
    a run stopped by a signal into its message and exit status 128 + the signal (143 for
    SIGTERM, 130 for Ctrl-C), and a Ctrl-C outside a training loop into exit status 130."""
    try:
        yield
    except USER_ERRORS as error:
        sys.exit(f"error: {_one_line(error)}")
    except stopping.Stopped as stopped:
        print(_one_line(stopped), file=sys.stderr)
        sys.exit(128 + stopped.signum)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)


def not_the_tpu_note(record: logging.LogRecord) -> bool:
    """False for JAX's INFO note that its TPU backend did not start (``libtpu.so`` is absent),
    logged on every machine without a TPU; True for everything else, warnings included (JAX
    warns when a TPU seems present but cannot be used)."""
    note = record.getMessage().startswith("Unable to initialize backend 'tpu'")
    return record.levelno > logging.INFO or not note


def run(main: Callable[[list[str]], None], *, config_from_workdir: bool = False) -> None:
    """Run the entry point ``main`` with :func:`parse_flags` (``config_from_workdir``: as
    there), without the TPU note (the filter is on JAX's backend logger before JAX starts its
    backends, at the first computation), the current folder importable after everything
    else (it shadows no installed module)."""
    logging.getLogger("jax._src.xla_bridge").addFilter(not_the_tpu_note)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    parser = functools.partial(parse_flags, config_from_workdir=config_from_workdir)
    app.run(main, flags_parser=parser)
