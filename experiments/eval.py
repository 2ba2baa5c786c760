"""Evaluate a run: ``python experiments/eval.py --workdir DIR [--config configs/x.py]``.

Restores the latest checkpoint of ``--workdir`` and evaluates every held-out split (the
config defaults to the one the run saved; ``--config.task.*`` and ``--config.train.*``
overrides apply to it, e.g. ``--config.train.eval_batches=16``) into ``DIR/eval.json``. A
*memory session* continues a deployed model's fast-weight memory: ``--load_memory PATH``
starts from a saved memory state (of this model: another model's is refused),
``--save_memory PATH`` saves the one the session ends with (the memory carries through the
eval batches; needs a level with ``persist="stream"``); each session's results are appended to
``DIR/sessions.jsonl``. The multi-process flags of ``experiments/train.py`` evaluate with
several processes (sessions run in one process). Everything is in ``nested.run.train``.
"""

from absl import flags
from ml_collections import config_flags

from nested.run import cli, distributed, evaluation

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file; default: the run's.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run to evaluate.")
_LOAD_MEMORY = flags.DEFINE_string("load_memory", None, "Memory state to start the session from.")
_SAVE_MEMORY = flags.DEFINE_string("save_memory", None, "Where to save the session's memory.")
_DISTRIBUTED = distributed.define_flags()
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    with cli.user_errors():
        distributed.initialize(distributed.settings_from_flags(_DISTRIBUTED))
        evaluation.evaluate_workdir(
            _CONFIG.value,
            _WORKDIR.value,
            load_memory=_LOAD_MEMORY.value,
            save_memory=_SAVE_MEMORY.value,
        )


if __name__ == "__main__":
    cli.run(main, config_from_workdir=True)
