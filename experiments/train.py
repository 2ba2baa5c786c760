"""Train a nested system: ``python experiments/train.py --config configs/mqar.py --workdir DIR``.

The config file (``get_config()``; ``path.py:variant`` picks a variant) declares the task,
the model, its fast levels and the training settings; ``--config.<key>=<value>`` overrides
any key (``--config.model.dim=128``, ``--config.levels.memory.every=16``, a rule of your own
by import path: ``--config.levels.memory.rule=my_rules:recipe``); ``--config.train.smoke=True``
makes a short check run of the config. A workdir that holds checkpoints of an interrupted run
resumes it. Several processes (hosts) train one run with ``--coordinator_address``,
``--num_processes`` and ``--process_id`` on each, or ``--distributed`` on a cluster whose
environment says so (``nested.run.distributed``; ``python -m nested.launch`` starts them on
this machine). Everything else is in ``nested.run.train``.
"""

from absl import flags
from ml_collections import config_flags

from nested.run import cli, distributed, train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, plots.")
_DISTRIBUTED = distributed.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    with cli.user_errors():
        distributed.initialize(distributed.settings_from_flags(_DISTRIBUTED))
        train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    cli.run(main)
