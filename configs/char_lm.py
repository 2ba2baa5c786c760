"""python experiments/train.py --config configs/char_lm.py --workdir runs/char_lm

Byte-level language modelling on real text (``nested.data.CharLMTask``): by default the
Python standard library's own sources, held-out files scored in bits per character.
``--config.task.path=/some/text/or/folder`` trains on other text.

Variants: ``configs/char_lm.py:<variant>`` with a variant of ``VARIANTS`` (default
``delta``); a variant is the memory level's rule and settings, so adding one (Hope, when
its model is registered) is one line there. Overrides as usual:
``--config.levels.memory.every=16``, ``--config.model.dim=256``.
"""

from ml_collections import config_dict

from nested import config as nc

VARIANTS = {
    "delta": dict(rule="delta"),  # DeltaNet, online
    "ttt_linear": dict(rule="ttt_linear"),  # TTT-Linear, mini-batches of 16 tokens
    "ttt_mlp": dict(rule="ttt_mlp"),  # TTT-MLP
    "titans": dict(rule="titans", every=16),  # Titans' neural memory, chunks of 16
}


def get_config(arg=None):
    variant = arg or "delta"
    if variant not in VARIANTS:
        raise nc.ConfigError(f"configs/char_lm.py:{variant}: allowed variants {sorted(VARIANTS)}")
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("char_lm", seq_len=128)
    layer = nc.RULE_LAYER.get(VARIANTS[variant]["rule"], {})
    config.model = nc.model_config("memory_lm", level="memory", dim=128, heads=4, layers=2, **layer)
    config.levels = config_dict.ConfigDict({"memory": nc.level_config(**VARIANTS[variant])})
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=2e-3, weight_decay=0.1, b2=0.98, warmup_steps=100
    )
    config.train = nc.train_config(
        steps=3000,
        batch_size=16,
        log_every=50,
        eval_every=500,
        eval_batches=8,
        eval_batch_size=16,
        checkpoint_every=500,
    )
    return config
